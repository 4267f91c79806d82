"""Mixture-of-experts weights between the Hugging Face MODEL (transformers 5) and the CHECKPOINT
format the weight sync speaks.

transformers 5 builds Qwen3-MoE, Qwen2-MoE and Mixtral with each layer's experts fused into two
3-D parameters (``from_pretrained`` merges the checkpoint's tensors, ``save_pretrained`` splits
them back)::

    model.layers.L.mlp.experts.gate_up_proj [E, 2I, H]  = stack_e(cat(gate_e, up_e))
    model.layers.L.mlp.experts.down_proj    [E, H, I]   = stack_e(down_e)

while checkpoints, mbridge's export and vLLM's loader name one tensor per expert::

    model.layers.L.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight           (Qwen MoE)
    model.layers.L.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight                  (Mixtral)

(Mixtral's router is ``block_sparse_moe.gate.weight`` in the checkpoint, ``mlp.gate.weight`` in the
model.) The weight sync's "HF names" are the checkpoint's, whatever the backend: the FSDP backend
splits its fused parameters (``to_checkpoint``), the hf engine copies a checkpoint tensor into its
slice of the fused parameter (``checkpoint_slot``) and reads its weights back split. Every other
name passes through unchanged, as does every name of a dense model.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Optional, Tuple

import torch

# model_type -> (the checkpoint's MoE block name, (gate, up, down) projection names)
LAYOUTS = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_FUSED = re.compile(r"^(?P<pre>.*\.layers\.\d+)\.mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")
_CKPT = re.compile(r"^(?P<pre>.*\.layers\.\d+)\.(?P<block>\w+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")


def layout(model_type: Optional[str]):
    return LAYOUTS.get(model_type or "")


def to_checkpoint(name: str, tensor: torch.Tensor, model_type: Optional[str]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The model's ``(name, tensor)`` under checkpoint names: a fused expert parameter as one
    tensor per expert (views; meta tensors work), Mixtral's ``mlp.`` as ``block_sparse_moe.``."""
    lay = layout(model_type)
    if lay is None:
        yield name, tensor
        return
    block, (gate, up, down) = lay
    m = _FUSED.match(name)
    if m is None:
        if block != "mlp" and re.search(r"\.layers\.\d+\.mlp\.", name):
            name = re.sub(r"(\.layers\.\d+)\.mlp\.", rf"\1.{block}.", name, count=1)
        yield name, tensor
        return
    pre = f"{m['pre']}.{block}.experts"
    for e in range(tensor.shape[0]):
        if m["which"] == "down_proj":
            yield f"{pre}.{e}.{down}.weight", tensor[e]
        else:
            g, u = tensor[e].chunk(2, dim=0)
            yield f"{pre}.{e}.{gate}.weight", g
            yield f"{pre}.{e}.{up}.weight", u


def checkpoint_slot(name: str, model_type: Optional[str], own: Dict[str, torch.Tensor]) -> Tuple[str, torch.Tensor]:
    """``(model name, view)``: where the checkpoint tensor ``name`` lives in the model's state
    ``own`` (a slice of a fused expert parameter, or the parameter itself). A name with no place
    returns ``(name, None)`` view-less: the caller reports it."""
    lay = layout(model_type)
    if lay is None:
        return name, own.get(name)
    block, (gate, up, down) = lay
    m = _CKPT.match(name)
    if m is None or m["block"] != block or m["proj"] not in (gate, up, down):
        if block != "mlp":
            name = re.sub(rf"(\.layers\.\d+)\.{block}\.", r"\1.mlp.", name, count=1)
        return name, own.get(name)
    e, proj = int(m["e"]), m["proj"]
    fused = f"{m['pre']}.mlp.experts.{'down_proj' if proj == down else 'gate_up_proj'}"
    param = own.get(fused)
    if param is None or e >= param.shape[0]:
        return fused, None
    if proj == down:
        return fused, param[e]
    half = param.shape[1] // 2
    return fused, param[e, :half] if proj == gate else param[e, half:]


def model_to_checkpoint(state: Dict[str, torch.Tensor], model_type: Optional[str]) -> Dict[str, torch.Tensor]:
    """A whole state dict under checkpoint names (``to_checkpoint`` of each entry, in order)."""
    return {n: t for name, value in state.items() for n, t in to_checkpoint(name, value, model_type)}
