"""How many routed experts an MoE model has, read from its Hugging Face config (0: a dense model).

Families spell the count differently: ``num_experts`` (Qwen2/3-MoE), ``num_local_experts``
(Mixtral), ``n_routed_experts`` (DeepSeek). One place reads them for the flag checks, the
Megatron setup and the HF routers."""

from __future__ import annotations

import json
import os

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_experts(config) -> int:
    """Routed experts per MoE layer of ``config`` (a config.json dict or an HF config object)."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    for key in EXPERT_COUNT_KEYS:
        if get(key):
            return int(get(key))
    return 0


def checkpoint_num_experts(hf_checkpoint) -> int:
    """``num_experts`` of ``hf_checkpoint``'s config.json (0: no checkpoint, dense, or unreadable)."""
    if not hf_checkpoint:
        return 0
    try:
        with open(os.path.join(str(hf_checkpoint), "config.json")) as f:
            return num_experts(json.load(f))
    except (OSError, ValueError):
        return 0
