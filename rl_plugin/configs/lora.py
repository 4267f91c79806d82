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

from dataclasses import dataclass
from typing import Optional, Tuple

from rl_plugin.flags import Bounds, Declared, flag

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
            "weight sync carries only them."
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
    check_lora_weight_equal: bool = flag(
        "--check-lora-weight-equal",
        action="store_true",
        group=GROUP,
        help="After every sync, read the adapters (or the merged weights they give) back from the engine and compare them bitwise with the trainer's.",
    )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @classmethod
    def check(cls, args) -> None:
        """Rules come with the backends' LoRA (issue 34)."""
