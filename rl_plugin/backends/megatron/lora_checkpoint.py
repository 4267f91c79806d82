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

The adapters' metadata (rank, alpha, targets, the base's identity) is the ``lora.json`` both
backends write and check (``rl_plugin.checkpoint.lora_meta``, from ``MegatronBackend.save_checkpoint``
/ ``load_checkpoint``): a checkpoint written with another adapter shape, on another base, or
without LoRA (and a full-model checkpoint into a LoRA run) is refused there, before any tensor loads.
"""

from __future__ import annotations

from typing import Any, Dict

from rl_plugin.backends.megatron.lora_model import local_adapters


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
