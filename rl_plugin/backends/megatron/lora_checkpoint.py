"""Adapter-only checkpoints of the Megatron backend with LoRA (issue 34).

With ``--lora-rank`` the base weights never change (they come from ``--hf-checkpoint`` / the
embedded seed on every start), so a checkpoint holds only the adapters and their optimizer state:
``model_sharded_state_dict`` replaces the GPTModel's ``sharded_state_dict`` with one
``ShardedTensor`` per adapter parameter, keyed by its canonical PEFT name (the global layer number
is in the name, so no pipeline offsets), split over TP as the parameter is (column-parallel B by
rows, row-parallel A by columns) or replicated. megatron's optimizer maps its state to these by
parameter identity (``optimizer.sharded_state_dict(model_sd)``), so the Adam moments (and the
distributed optimizer's fp32 main params) are saved in model space, reshardable across TP x DP x PP
like the full model's (``checkpoint.py``).

``lora_meta(lora_cfg)`` goes into ``common.pt``; ``check_lora_meta`` refuses a checkpoint written
with another rank / alpha / targets, or without LoRA (and a full-model checkpoint into a LoRA run).
The base checkpoint's identity (refusing adapters trained on another base) is the shared
checkpoint layer's ``lora.json`` (``rl_plugin.checkpoint.lora_base``), written and checked by
``MegatronBackend.save_checkpoint`` / ``load_checkpoint``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from rl_plugin.backends.megatron.lora_model import local_adapters
from rl_plugin.lora.targets import resolve_targets


def model_sharded_state_dict(model) -> Dict[str, Any]:
    """``{canonical name: ShardedTensor}`` of this rank's adapters (module docstring)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out: Dict[str, Any] = {}
    for name, param, module, which in local_adapters(model):
        dim = module.partition_dim(which)
        if dim is None:
            out[name] = make_sharded_tensor_for_checkpoint(param, name)
        else:
            out[name] = make_tp_sharded_tensor_for_checkpoint(param, name, tp_axis=dim)
    return out


def load_model_state(model, state: Dict[str, Any]) -> None:
    """The loaded adapter tensors (this rank's shards, as asked) into the parameters."""
    import torch

    with torch.no_grad():
        for name, param, _, _ in local_adapters(model):
            param.copy_(state[name])


def lora_meta(lora_cfg) -> Optional[Dict[str, Any]]:
    if lora_cfg is None or not lora_cfg.enabled:
        return None
    return {
        "rank": lora_cfg.lora_rank,
        "alpha": lora_cfg.lora_alpha,
        "targets": list(resolve_targets(lora_cfg.target_modules, lora_cfg.exclude_modules)),
    }


class LoraCheckpointError(ValueError):
    pass


def check_lora_meta(src, saved: Optional[Dict[str, Any]], current: Optional[Dict[str, Any]]) -> None:
    """Refuse a checkpoint whose adapters are not this run's (module docstring)."""
    if saved == current:
        return
    if current is None:
        raise LoraCheckpointError(
            f"--load {src}: it holds LoRA adapters only (rank {saved['rank']}), and this run trains the full model. "
            f"Fix: resume with --lora-rank {saved['rank']} --lora-alpha {saved['alpha']} --target-modules "
            f"{' '.join(saved['targets'])}."
        )
    if saved is None:
        raise LoraCheckpointError(
            f"--load {src}: it is a full-model checkpoint and this run trains LoRA adapters. Fix: drop --lora-rank to "
            "resume it, or start the LoRA run from its weights (--save-hf, then --hf-checkpoint)."
        )
    raise LoraCheckpointError(
        f"--load {src}: its adapters are {saved}, this run's {current}. Fix: resume with the checkpoint's "
        "--lora-rank / --lora-alpha / --target-modules."
    )
