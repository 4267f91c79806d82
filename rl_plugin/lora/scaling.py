"""The LoRA scale, computed in one place: a targeted linear computes ``W x + s B A x`` with
``s = alpha / r`` (Hu et al. 2021; PEFT's ``scaling = lora_alpha / r``).

Every reader takes it from here: the Megatron adapters' forward (``backends/megatron/lora.py``),
the FSDP merged export (``backends/fsdp/backend.py``; PEFT's own layers compute the same
quotient), the hf engine's merge into its kept base, vLLM's read-back of ``lora_b * s`` and the
rule that asks for a power of two under ``--check-lora-weight-equal`` (``configs/lora.py``).
"""

from __future__ import annotations


def lora_scaling(alpha: float, rank: int) -> float:
    """``s = alpha / r``: the factor of the adapter's update ``B A`` (``rank`` > 0)."""
    return alpha / rank
