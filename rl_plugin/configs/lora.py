"""LoraConfig: low-rank adapters on the policy (miles' flag names), the same on both backends.

With ``--lora-rank r > 0`` every targeted linear W (out x in) of the policy is frozen and trained
through W' = W + (alpha / r) * B @ A, A: r x in, B: out x r, B = 0 at the start (PEFT's
initialisation) so the first forward equals the base model's. Adapters are named as PEFT names
them on the Hugging Face model (``...q_proj.lora_A.weight``, ``...lora_B.weight``) on both
backends, so a sync carries the same tensors and a PEFT directory is one save.

``--target-modules all-linear`` means the attention projections q/k/v/o and the MLP's
gate/up/down (PEFT's ``all-linear`` without the LM head); explicit names may be HF leaf names
(``q_proj``) or Megatron names (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from rl_plugin.errors import fail
from rl_plugin.flags import Bounds, Declared, flag, flag_of
from rl_plugin.lora.peft_dir import missing_files
from rl_plugin.lora.scaling import lora_scaling
from rl_plugin.lora.targets import MLP, UnknownTargetError, resolve_targets

GROUP = "lora"


@dataclass(frozen=True)
class LoraConfig(Declared):
    lora_rank: int = flag(
        "--lora-rank",
        type=int,
        default=0,
        group=GROUP,
        bounds=Bounds(0, "--lora-rank 8"),
        help=(
            "Rank r of the LoRA adapters (Hu et al. 2021; miles --lora-rank). 0 (the default): the whole model "
            "trains. r > 0: the targeted linears are frozen and each trains W + (alpha/r) B A with A: r x in, "
            "B: out x r (B starts at 0); only the adapters get gradients, optimizer state and checkpoints, and a "
            "weight sync carries only them. Learning rate: LoRA's first steps move a weight ~sqrt(r / (3 in)) * "
            "alpha/r times less than full training at the same --lr, so scale --lr by ~sqrt(3 in / r) / (alpha/r) "
            "(~9x for a 896-wide model, ~20x at 4096: the usual ~10x); the embedded default uses 5/3x (its model "
            "is 64 wide)."
        ),
    )
    lora_alpha: float = flag(
        "--lora-alpha",
        type=float,
        default=16.0,
        group=GROUP,
        bounds=Bounds(0, "--lora-alpha 16", low_open=True),
        help="LoRA scaling numerator: the adapter's update is (alpha / r) B A (PEFT's lora_alpha).",
    )
    lora_dropout: float = flag(
        "--lora-dropout",
        type=float,
        default=0.0,
        group=GROUP,
        bounds=Bounds(0, "--lora-dropout 0.05", high=1.0),
        help="Dropout on the adapter's input (PEFT's lora_dropout); 0 keeps the loss deterministic.",
    )
    target_modules: Tuple[str, ...] = flag(
        "--target-modules",
        nargs="+",
        default=("all-linear",),
        group=GROUP,
        help=(
            "Which linears get adapters: all-linear (q/k/v/o and gate/up/down, never the LM head), or names: HF "
            "leaf names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj) or Megatron names (linear_qkv "
            "linear_proj linear_fc1 linear_fc2), space- or comma-separated."
        ),
    )
    exclude_modules: Optional[Tuple[str, ...]] = flag(
        "--exclude-modules",
        nargs="+",
        default=None,
        group=GROUP,
        help="Names (same spellings as --target-modules) to leave without adapters.",
    )
    lora_adapter_path: Optional[str] = flag(
        "--lora-adapter-path",
        default=None,
        group=GROUP,
        help="A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start the adapters from.",
    )
    save_hf_merged: Optional[str] = flag(
        "--save-hf-merged",
        default=None,
        group=GROUP,
        help=(
            "With --lora-rank: at every save also write the merged model (W + (alpha/r) B A, adapters folded in) as a "
            "Hugging Face directory here, for engines or tools without LoRA support; --save-hf then holds the PEFT "
            "adapter directory."
        ),
    )
    check_lora_weight_equal: bool = flag(
        "--check-lora-weight-equal",
        action="store_true",
        group=GROUP,
        help="After every sync, read the adapters (or the merged weights they give) back from the engine and compare them bitwise with the trainer's.",
    )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    def shape_flags_given(self) -> list:
        """``--flag value`` of each adapter-shape flag set away from its default (read at rank 0 only)."""
        given = []
        for name in ("lora_alpha", "lora_dropout", "target_modules", "exclude_modules"):
            spec, value = flag_of(type(self), name), getattr(self, name)
            norm = tuple(value) if isinstance(value, list) else value  # nargs="+" parses to a list
            if norm != spec.default:
                shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else f"{value:g}"
                given.append(f"{spec.names[0]} {shown}")
        return given

    def check(self, run) -> None:
        """Fail-loud rules (``rl_plugin.errors.fail``), static: what the flags alone decide."""
        rank = self.lora_rank
        if not rank:
            for name, value in (
                ("--check-lora-weight-equal", self.check_lora_weight_equal),
                ("--lora-adapter-path", self.lora_adapter_path),
                ("--save-hf-merged", self.save_hf_merged),
            ):
                if value:
                    fail(
                        f"{name} without --lora-rank",
                        "it only means something for LoRA adapters",
                        "add --lora-rank 8 (or drop the flag)",
                    )
            shape = self.shape_flags_given()
            if shape:
                fail(
                    f"{' '.join(shape)} with --lora-rank {rank}",
                    "LoRA is off at rank 0 (the whole model trains), so these adapter settings would be ignored",
                    "add --lora-rank 8 to train adapters, or drop those flags to train the whole model",
                )
            return
        try:
            targets = resolve_targets(self.target_modules, self.exclude_modules)
        except UnknownTargetError as exc:
            fail("--target-modules / --exclude-modules", str(exc), "use all-linear, HF leaf names or Megatron names")
        if self.lora_adapter_path:
            missing = missing_files(self.lora_adapter_path)
            if missing:
                fail(
                    f"--lora-adapter-path {self.lora_adapter_path}",
                    f"not a PEFT adapter directory: {', '.join(missing)} missing",
                    "pass a directory written by --save-hf with --lora-rank (or PeftModel.save_pretrained)",
                )
        if self.lora_dropout > 0 and run.train.use_rollout_logprobs:
            fail(
                f"--lora-dropout {self.lora_dropout} with --use-rollout-logprobs",
                "adapter dropout makes the training forward random, while the engine's log-probs (taken as the old "
                "policy's) have none: the PPO ratio would carry dropout noise from the first step, clipping it",
                "use --lora-dropout 0 (the default), or drop --use-rollout-logprobs (the trainer then recomputes "
                "the old log-probs in eval mode)",
            )
        if run.rollout.engine.engine == "sglang":
            fail(
                "--lora-rank with --rollout-engine sglang",
                "the SGLang engine here loads full weights only (no adapter loading, no merge from a kept base)",
                "use --rollout-engine vllm (LoRARequest) or hf",
            )
        if (
            run.rollout.engine.engine == "vllm"
            and run.async_training.fully_async
            and run.async_training.pause_generation_mode == "in_place"
        ):
            fail(
                "--lora-rank with --rollout-engine vllm --fully-async --pause-generation-mode in_place",
                "vLLM serves the adapters as a LoRARequest fixed when a request is submitted; a request kept in place "
                "across a weight update would go on under the old adapters while its tokens are labelled with the new version",
                "use --pause-generation-mode retract (a retracted request is resubmitted with the new adapters), or --rollout-engine hf",
            )
        scaling = lora_scaling(self.lora_alpha, rank)
        if self.check_lora_weight_equal and run.rollout.engine.engine == "vllm":
            if scaling <= 0 or math.frexp(scaling)[0] != 0.5:  # not a power of two
                fail(
                    f"--check-lora-weight-equal with --rollout-engine vllm and --lora-alpha {self.lora_alpha:g} / "
                    f"--lora-rank {rank} = {scaling:g}",
                    "vLLM stores B times alpha/r, so its read-back divides by alpha/r, bitwise only for a power of two",
                    f"use --lora-alpha {2 * rank} (alpha/r = 2), or drop the check",
                )
        experts = _checkpoint_experts(run.train.model.hf_checkpoint)
        mlp = [t for t in targets if t in MLP]
        if experts and mlp:
            fail(
                f"--target-modules {' '.join(mlp)} on the mixture-of-experts --hf-checkpoint ({experts} experts)",
                "LoRA on the experts is not supported (their projections are fused per layer in both backends)",
                "--exclude-modules gate_proj up_proj down_proj (attention-only adapters)",
            )


def _checkpoint_experts(hf_checkpoint: Optional[str]) -> int:
    """The routed-expert count in an HF directory's config.json (0: dense or no file)."""
    import json
    from pathlib import Path

    if not hf_checkpoint or not (Path(hf_checkpoint) / "config.json").is_file():
        return 0
    cfg = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    return int(next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)), 0))
