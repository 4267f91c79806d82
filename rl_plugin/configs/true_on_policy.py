"""TrueOnPolicyConfig: ``--true-on-policy-mode`` and ``--deterministic-mode`` (miles' and slime's
names), and what each cannot be combined with.

``--true-on-policy-mode``: the engine and the trainer compute every op that produces a token's
probability through one op library (``rl_plugin.invariant``: batch- and position-invariant linear
layers, attention, norms, RoPE, log-softmax and LM head), and the engine samples from
``exp(log_softmax(logits / T))`` of those ops, so the trainer's recomputed log-prob of every sampled
token equals the engine's bitwise: the PPO ratio is exactly 1 at the first step of each rollout.
The run config hands it down as two plain fields (nothing below the command line reads the flags):
``TrainConfig.true_on_policy`` (both backends) and ``EngineConfig.true_on_policy`` (the ``hf``
engine). Refused where the bits cannot match (``check``):

- ``--rollout-engine vllm`` / ``sglang``: their kernels (vLLM's CPU build: oneDNN linear layers
  and paged attention over its KV cache; SGLang's CUDA kernels) are not the trainer's, and no
  rescoring path recomputes their samples' log-probs with the trainer's ops. The measured
  mismatch of vLLM's CPU build is in ``docs/benchmarks.md``.
- ``--bf16``: the op library computes in fp32; in bf16 the trainer rounds its activations where
  the engine does not (``--fp16`` both backends refuse already).
- ``--lora-rank > 0``: the engine merges the adapters into each weight (``W + s B A``, one
  matmul) while the trainer applies them beside it (``W x + s B (A x)``): two reduction orders.
- ``--context-parallel-size > 1``: attention is then split over ranks (zigzag chunks combined by
  transformer-engine), not the op library's fixed key blocks.
- ``--rollout-top-p < 1``: the engine's log-prob is then under the renormalised nucleus, which the
  trainer does not model.

TIS / MIS (``--use-tis``, ``--tis-mode mask``) stay allowed: with the mode every weight is exactly 1
(pi_old / pi_rollout = 1), so they are no-ops; ``note`` says so at start-up.

``--deterministic-mode`` (what slime's flag does that applies on a CPU): every process of the run
calls ``torch.use_deterministic_algorithms(True)`` (an op without a deterministic implementation
raises instead of running), keeps the seeds the run already sets (``--seed``: the backends' model
init and the engines' per-request generators), and runs a fixed torch thread count: 1 per process
whatever the node's cores, unless ``RL_PLUGIN_TRAIN_THREADS`` / ``RL_PLUGIN_ROLLOUT_THREADS`` /
``RL_PLUGIN_ENGINE_THREADS`` name another (``rl_plugin.threads``), so a rerun on a machine with
other cores sums in the same order. What it cannot fix on a CPU is named in docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag

GROUP = "true on-policy"
MODE = "--true-on-policy-mode"
DETERMINISTIC = "--deterministic-mode"


@dataclass(frozen=True)
class TrueOnPolicyConfig(Declared):
    mode: bool = flag(
        MODE,
        action="store_true",
        group=GROUP,
        help=(
            "Remove the train-inference mismatch instead of correcting it (miles' flag): the hf engine and the "
            "trainer (both backends) compute through one batch- and position-invariant op library, and the engine "
            "samples from the probabilities those ops give, so the trainer's log-prob of every sampled token equals "
            "the engine's bitwise (check it with --ci-test --ci-train-rollout-logprob-abs-diff-threshold 0). fp32, "
            "hf engine, no LoRA, no context parallelism. TIS/MIS are no-ops under it."
        ),
    )
    deterministic: bool = flag(
        DETERMINISTIC,
        action="store_true",
        group=GROUP,
        help=(
            "Bit-reproducible reruns (slime's flag, what applies on a CPU): torch.use_deterministic_algorithms(True) "
            "in every process, the run's --seed, and a fixed torch thread count (1 per process unless "
            "RL_PLUGIN_TRAIN_THREADS / RL_PLUGIN_ROLLOUT_THREADS / RL_PLUGIN_ENGINE_THREADS set one), so the result "
            "does not depend on the machine's core count. Slower on models large enough to use several threads."
        ),
    )

    def check(self, run) -> None:
        if not self.mode:
            return
        engine = run.rollout.engine
        if engine.engine != "hf":
            fail(
                f"{MODE} with --rollout-engine {engine.engine}",
                f"{engine.engine} computes with its own kernels (linear layers, attention over its KV cache, "
                "sampler), not the trainer's invariant ops, so its log-probs cannot equal the trainer's bitwise; "
                "there is no path that rescores its samples with the trainer's ops (docs/benchmarks.md has the "
                "measured mismatch of vLLM's CPU build)",
                f"use --rollout-engine hf with {MODE}, or drop {MODE} and correct the mismatch with --use-tis",
            )
        model = run.train.model
        if model.bf16:  # --fp16: both backends refuse it already (TrainConfig.check)
            fail(
                f"{MODE} with --bf16",
                "the invariant ops compute in fp32; in bf16 the trainer rounds its activations where the engine "
                "does not, so the log-probs differ",
                "drop --bf16 (fp32 training)",
            )
        if run.train.lora.lora_rank > 0:
            fail(
                f"{MODE} with --lora-rank {run.train.lora.lora_rank}",
                "the engine merges the adapters into each weight (W + s B A, one matmul) while the trainer applies "
                "them beside it (W x + s B (A x)): two reduction orders, two results",
                "drop --lora-rank (full fine-tuning), or drop the mode",
            )
        if model.context_parallel_size > 1:
            fail(
                f"{MODE} with --context-parallel-size {model.context_parallel_size}",
                "context parallelism splits attention over ranks in zigzag chunks (transformer-engine), not the "
                "op library's fixed key blocks",
                "use --context-parallel-size 1 (tensor and data parallelism keep the bits)",
            )
        if engine.top_p < 1:
            fail(
                f"{MODE} with --rollout-top-p {engine.top_p}",
                "the engine's log-prob is then under the renormalised nucleus, which the trainer's does not model",
                "use --rollout-top-p 1.0",
            )

    def note(self, run) -> Optional[str]:
        """The start-up note of a mode with TIS / MIS on (None: nothing to say)."""
        if not (self.mode and run.train.loss.use_tis):
            return None
        kind = "MIS (--tis-mode mask)" if run.train.loss.tis_mode == "mask" else "TIS (--use-tis)"
        return (
            f"note: {MODE}: {kind} is a no-op: the engine's and the trainer's log-probs are equal bitwise, so every "
            "importance weight pi_old / pi_rollout is exactly 1"
        )
