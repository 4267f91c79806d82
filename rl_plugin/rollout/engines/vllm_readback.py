"""vLLM's weights read back under the trainer's names, for ``--check-weight-sync``.

Plain parameters are read as they are. vLLM's CPU build
repacks linear weights into an opaque GEMM handle (the parameter becomes empty); those are read
through the layer's own kernel as ``linear(I) = I W^T = W^T``, which is bitwise exact in fp32/bf16
(each output is one product ``w * 1`` plus exact zeros; only a stored ``-0.0`` reads as ``+0.0``).
A tied LM head is read through its kernel too: where its packed copy differs from the embedding,
that copy is reported as the embedding (what the logits use), so the check fails on it.
Fused parameters are split back into the Hugging Face names by the layer's output sizes (a fused
MoE layer's ``w13_weight`` / ``w2_weight`` into one tensor per expert under the checkpoint's
projection names), and the vocabulary padding of the embedding and LM head is cut off.
Vision-language models: vLLM's module prefixes map back to the checkpoint's through the model's
own ``hf_to_vllm_mapper`` (``checkpoint_names``); the vision tower's ``attn.qkv`` is fused in the
checkpoint too and read as it is.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch


def read_hf_weights(worker, vocab_size: int, tied: bool) -> Dict[str, torch.Tensor]:
    """Runs inside a vLLM worker: the model's weights under their Hugging Face names (see the
    module docstring for packed CPU linears and fused parameters)."""
    model = worker.model_runner.model
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                value = param.detach()
                if pname == "weight" and value.numel() == 0 and hasattr(module, "cpu_linear"):
                    value = _probe_linear(module)
                if pname in EXPERT_PARAMS and hasattr(module, "rl_plugin_raw"):
                    value = _repacked_source(module, pname, value)
                split = _split_experts if pname in EXPERT_PARAMS and hasattr(module, "ckpt_gate_proj_name") else None
                parts = split(module_name, pname, value, module) if split else None
                for name, part in parts or _split_fused(module_name, pname, value, module, packed):
                    out[name] = part.to("cpu").clone()
        head = getattr(model, "lm_head", None)
        if tied and head is not None and hasattr(head, "cpu_linear") and head.weight.numel() > 0:
            out["lm_head.weight"] = _probe_linear(head, int(head.weight.shape[1])).to("cpu")
    out = checkpoint_names(model, out)
    for name in [n for n in out if n.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        out[name] = out[name][:vocab_size]  # vLLM pads the vocabulary
    if tied and "lm_head.weight" in out and not torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"]):
        out["model.embed_tokens.weight"] = out["lm_head.weight"]  # the head's copy is what the logits use
    if tied and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def checkpoint_names(model, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``weights`` under the names the trainer sends: vLLM's module prefixes mapped back through
    the model's own ``hf_to_vllm_mapper`` (Qwen2.5-VL: ``language_model.model.`` ->
    ``model.language_model.``, ``visual.`` -> ``model.visual.``, ``language_model.lm_head.`` ->
    ``lm_head.``; where several checkpoint prefixes map to one, the first listed: transformers 5's)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    back: Dict[str, str] = {}
    for orig, new in (getattr(mapper, "orig_to_new_prefix", None) or {}).items():
        if new is not None:
            back.setdefault(new, orig)
    prefixes = sorted(back, key=len, reverse=True)  # the longest vLLM prefix wins
    out: Dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        new = next((p for p in prefixes if name.startswith(p)), None)
        out[name if new is None else back[new] + name[len(new) :]] = value
    return out


def _probe_linear(module, k: Optional[int] = None) -> torch.Tensor:
    """W of a linear whose weight vLLM's CPU build repacked: ``cpu_linear(I) = I W^T`` (exact);
    ``k``: the input size (default the layer's ``input_size_per_partition``)."""
    if k is None:  # a replicated linear (an MoE router's GateLinear) has no per-partition size
        k = int(getattr(module, "input_size_per_partition", None) or module.input_size)
    eye = torch.eye(k, dtype=module.weight.dtype if module.weight.numel() else module.params_dtype)
    return module.cpu_linear(eye, module.weight, None).t().contiguous()


EXPERT_PARAMS = ("w13_weight", "w2_weight")  # vLLM's fused MoE experts: [E, 2I, H] (gate; up), [E, H, I]


def _repacked_source(module, pname: str, live: torch.Tensor) -> torch.Tensor:
    """The checkpoint-layout tensor a re-packed expert parameter (``_repack_experts``) was packed
    from, if the live (packed) parameter is still exactly what that packing gave; else the live
    tensor, which then fails the comparison."""
    i = EXPERT_PARAMS.index(pname)
    return module.rl_plugin_raw[i] if torch.equal(live, module.rl_plugin_packed[i]) else live


def _split_experts(module_name: str, pname: str, value: torch.Tensor, module) -> List:
    """A fused MoE expert parameter as the checkpoint's one tensor per expert
    (``<block>.experts.{e}.<proj>.weight``, the projection names the layer loaded them under)."""
    if int(module.local_num_experts) != int(module.global_num_experts):
        raise NotImplementedError(
            "--check-weight-sync with an expert-parallel vLLM engine: the read-back gathers no expert shards"
        )
    prefix = module_name[: -len(".routed_experts")] if module_name.endswith(".routed_experts") else module_name
    out = []
    for e in range(value.shape[0]):
        if pname == "w2_weight":
            out.append((f"{prefix}.{e}.{module.ckpt_down_proj_name}.weight", value[e]))
        else:
            gate, up = value[e].chunk(2, dim=0)
            out.append((f"{prefix}.{e}.{module.ckpt_gate_proj_name}.weight", gate))
            out.append((f"{prefix}.{e}.{module.ckpt_up_proj_name}.weight", up))
    return out


def _split_fused(
    module_name: str, pname: str, value: torch.Tensor, module, packed: Dict[str, Sequence[str]]
) -> Iterable:
    """``(hf_name, tensor)`` pairs: a fused qkv/gate_up parameter split along its output dim (not
    one the checkpoint fuses too: Qwen2.5-VL's vision ``attn.qkv``)."""
    parent, _, leaf = module_name.rpartition(".")
    if leaf in packed and list(packed[leaf]) != [leaf] and hasattr(module, "output_partition_sizes"):
        sizes = list(module.output_partition_sizes)
        for sub, part in zip(packed[leaf], torch.split(value, sizes, dim=0)):
            yield f"{parent}.{sub}.{pname}", part
    else:
        yield f"{module_name}.{pname}", value
