"""Adapter names: PEFT's, on the HF model, for both backends.

The canonical name of an adapter is the HF module path of the projection plus
``.lora_A.weight`` / ``.lora_B.weight`` (``model.layers.3.mlp.up_proj.lora_B.weight``). That is
what both backends export for a weight sync and what a PEFT adapter file holds after the
``base_model.model.`` prefix PEFT adds on save (``peft_file_name``).
"""

from __future__ import annotations

PEFT_PREFIX = "base_model.model."


def hf_module_path(layer: int, projection: str) -> str:
    """The HF (Llama/Qwen2 family) module path of ``projection`` in decoder layer ``layer``."""
    block = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{projection}"


def lora_a_name(module_path: str) -> str:
    return f"{module_path}.lora_A.weight"


def lora_b_name(module_path: str) -> str:
    return f"{module_path}.lora_B.weight"


def peft_file_name(name: str) -> str:
    """The key of a canonical adapter name inside PEFT's ``adapter_model.safetensors``."""
    return PEFT_PREFIX + name


def canonical_name(peft_name: str) -> str:
    """The canonical name of a key read from a PEFT adapter file (prefix and adapter name dropped:
    ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    name = peft_name[len(PEFT_PREFIX) :] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
