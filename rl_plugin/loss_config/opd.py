"""On-policy distillation (OPD; slime's ``--use-opd`` flags): the student samples, a teacher
scores each sampled token, and the per-token reverse-KL estimate shifts the advantage

    A_t <- A_t - coef * (log p_student(y_t) - log p_teacher(y_t))      (loss mask 1 tokens)

added to whatever ``--advantage-estimator`` gives (GRPO + OPD; pure OPD with a constant reward,
whose group advantages are 0). ``log p_student`` is the old policy's (the log-probs the ratio is
taken against), so at the first step of a rollout the policy gradient of the shifted term is the
gradient of -coef * KL(student || teacher) estimated on the student's own samples (Agarwal et al.
2024, "On-policy distillation of language models"; Thinking Machines 2025, "On-policy
distillation"). Teacher log-probs come from a forward-only teacher in the train actors
(``megatron``, slime's name for "in the trainer": both backends) or from an engine that scores the
student's tokens as prompt log-probs (``hf``, ``vllm``; ``sglang`` is refused here: it cannot run
on this machine). The loss core applies the shift (``rl_plugin.loss.opd``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Bounds, flag

GROUP = "sft and distillation"
OPD_TYPES = ("megatron", "sglang", "vllm", "hf")
TEACHER_MAX_TOKENS = 8192  # --opd-type hf: padded tokens of one teacher forward
TEACHER_MEMORY_SHARE = 0.3  # --opd-type vllm on a GPU: the teacher's vLLM gpu_memory_utilization


@dataclass(frozen=True)
class OpdSettings:
    use_opd: bool = flag(
        "--use-opd",
        action="store_true",
        help=(
            "On-policy distillation: shift each sampled token's advantage by -coef * (log p_student - log p_teacher), "
            "the per-token reverse KL to a teacher (Agarwal et al. 2024; slime --use-opd). Works with any "
            "--advantage-estimator; a constant reward gives pure distillation. Needs --opd-teacher-load."
        ),
        group=GROUP,
    )
    opd_type: str = flag(
        "--opd-type",
        choices=OPD_TYPES,
        default="megatron",
        help=(
            "Where the teacher runs. megatron: a forward-only teacher in the train actors (either --train-backend; "
            "slime's name); hf / vllm: an engine beside the rollout engine scores the student's tokens (prompt "
            "log-probs), for a teacher that does not fit the trainer's layout; sglang: refused here."
        ),
        group=GROUP,
    )
    opd_kl_coef: float = flag(
        "--opd-kl-coef",
        type=float,
        default=1.0,
        help="coef of the OPD advantage shift (1.0: the reverse KL with the weight of a unit reward).",
        group=GROUP,
    )
    opd_teacher_load: Optional[str] = flag(
        "--opd-teacher-load",
        default=None,
        help="The teacher: a Hugging Face checkpoint directory (e.g. the --save-hf output of a trained run). Its tokenizer must be the student's.",
        group=GROUP,
    )
    opd_teacher_max_tokens: int = flag(
        "--opd-teacher-max-tokens",
        type=int,
        default=TEACHER_MAX_TOKENS,
        help=(
            "--opd-type hf: the token budget of one teacher forward (samples x their longest length, padded; a "
            "longer sample goes alone). The rollout is scored in such micro-batches, each token's log-prob through "
            "the fused LM head, so no [tokens, vocabulary] logits exist. Lower it when the teacher runs out of memory."
        ),
        group=GROUP,
        bounds=Bounds(1, f"--opd-teacher-max-tokens {TEACHER_MAX_TOKENS}"),
    )
    opd_teacher_gpu_memory_utilization: float = flag(
        "--opd-teacher-gpu-memory-utilization",
        type=float,
        default=TEACHER_MEMORY_SHARE,
        help=(
            "--opd-type vllm on a GPU: the fraction of the device the teacher's vLLM may take for its weights and "
            "KV cache (vLLM's gpu_memory_utilization, whose own default 0.9 would leave nothing beside it). The "
            "teacher lives in the rollout manager, on the device it shares (with --colocate: with engine 0, whose "
            "share is --rollout-gpu-memory-utilization, and train rank 0)."
        ),
        group=GROUP,
        bounds=Bounds(0, f"--opd-teacher-gpu-memory-utilization {TEACHER_MEMORY_SHARE}", low_open=True, high=1),
    )
    opd_teacher_ckpt_step: Optional[int] = flag(
        "--opd-teacher-ckpt-step",
        type=int,
        default=None,
        help="slime's step of a teacher checkpoint. A teacher is read from a Hugging Face directory only (pass the teacher run's --save-hf output), so this is refused for now.",
        group=GROUP,
    )

    def check(self, run) -> None:
        given = [
            f
            for f, on in (
                ("--opd-type", self.opd_type != "megatron"),
                ("--opd-kl-coef", self.opd_kl_coef != 1.0),
                ("--opd-teacher-load", self.opd_teacher_load is not None),
                ("--opd-teacher-ckpt-step", self.opd_teacher_ckpt_step is not None),
                ("--opd-teacher-max-tokens", self.opd_teacher_max_tokens != TEACHER_MAX_TOKENS),
                (
                    "--opd-teacher-gpu-memory-utilization",
                    self.opd_teacher_gpu_memory_utilization != TEACHER_MEMORY_SHARE,
                ),
            )
            if on
        ]
        if not self.use_opd:
            if given:
                fail(
                    f"{', '.join(given)} without --use-opd",
                    "distillation is off, so these settings would be silently ignored",
                    "add --use-opd, or drop them",
                )
            return
        if self.opd_teacher_load is None:
            fail("--use-opd without --opd-teacher-load", "distillation needs a teacher", "pass --opd-teacher-load DIR")
        if self.opd_type == "sglang":
            fail(
                "--opd-type sglang",
                "the SGLang engine cannot run on this build (no CUDA kernels), so it cannot serve the teacher",
                "use --opd-type megatron (in the trainer), hf or vllm",
            )
        if self.opd_teacher_ckpt_step is not None:
            fail(
                "--opd-teacher-ckpt-step",
                "a teacher is read from a Hugging Face directory only in this release",
                "pass the teacher run's --save-hf directory as --opd-teacher-load and drop --opd-teacher-ckpt-step",
            )
        for name, kind, changed in (
            ("--opd-teacher-max-tokens", "hf", self.opd_teacher_max_tokens != TEACHER_MAX_TOKENS),
            (
                "--opd-teacher-gpu-memory-utilization",
                "vllm",
                self.opd_teacher_gpu_memory_utilization != TEACHER_MEMORY_SHARE,
            ),
        ):
            if changed and self.opd_type != kind:
                fail(
                    f"{name} with --opd-type {self.opd_type}",
                    f"only the --opd-type {kind} teacher reads it, so it would be silently ignored",
                    f"use --opd-type {kind}, or drop {name}",
                )
        if not self.opd_kl_coef > 0:
            fail(
                f"--opd-kl-coef {self.opd_kl_coef}",
                "the coefficient must be > 0 (0 turns distillation off; < 0 pushes the student away from the teacher)",
                "use e.g. --opd-kl-coef 1.0, or drop --use-opd",
            )
