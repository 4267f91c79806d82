"""LoRA on the FSDP backend: PEFT's adapters on the Hugging Face model, before ``fully_shard``.

``apply_lora(model, cfg, seed)`` runs ``peft.get_peft_model`` with ``LoraConfig(r, lora_alpha,
lora_dropout, target_modules=<the resolved HF projection names>)`` on the (unsharded) HF model,
then overwrites every ``lora_A`` with ``rl_plugin.lora.init.initial_lora_a(<canonical name>,
r, in, seed)`` and every ``lora_B`` with zeros: PEFT's own init draws from the global RNG in
module order, ours depends on (seed, name, shape) only, so the Megatron backend starts from the
same adapters. Every other parameter is frozen (``requires_grad = False``): the optimizer, the
gradient reduction and the checkpoint see the adapters only.

The forward stays the HF model's: PEFT replaces each targeted ``nn.Linear`` in place by a
``lora.Linear`` computing ``W x + (alpha / r) B A dropout(x)``; the backend keeps calling the HF
model (``PeftModel.base_model.model``) and keeps the ``PeftModel`` only for
``disable_adapter()``: the reference policy (``--use-kl-loss``) is the base model, i.e. the same
sharded model with its adapters switched off (no second copy of the base).

A vision-language model (``vision.vision_model``): the adapters go on the language model's
projections only. Its vision tower has ``gate_proj`` / ``up_proj`` / ``down_proj`` too, so PEFT's
``target_modules`` becomes a regex over the full module path that leaves the tower out
(``peft_target_modules``), and the tower is frozen with everything else (verl's and TRL's choice:
LoRA on the LM, the tower fixed). The same regex goes into ``--save-hf``'s ``adapter_config.json``,
so PEFT, loading that directory onto the VL model, puts adapters exactly where they were trained.

Names: PEFT's state-dict key of an adapter is ``<module>.lora_A.default.weight``; the canonical
name (``rl_plugin.lora.names``) drops the adapter name (``<module>.lora_A.weight``); the base
weight of a targeted linear is ``<module>.base_layer.weight`` (``hf_name`` maps it back).
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, Tuple

import torch
from torch import nn

from rl_plugin.configs.lora import LoraConfig
from rl_plugin.lora.init import initial_lora_a
from rl_plugin.lora.names import canonical_name
from rl_plugin.lora.targets import MLP, resolve_targets

ADAPTER = "default"  # PEFT's adapter name
_LORA_KEY = re.compile(r"\.lora_([AB])\.default\.weight$")


def is_adapter_key(name: str) -> bool:
    """A state-dict key of an adapter tensor (``...lora_A.default.weight``)."""
    return _LORA_KEY.search(name) is not None


def hf_name(name: str) -> str:
    """A PEFT-wrapped base key back under its HF name (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def refuse_experts(model: nn.Module, targets) -> None:
    """MoE expert LoRA is out of reach here: a model with experts and an MLP projection targeted is refused."""
    cfg = model.config
    experts = next(
        (getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(cfg, k, 0)), 0
    )
    mlp = [t for t in targets if t in MLP]
    if experts and mlp:
        raise ValueError(
            f"--target-modules {' '.join(mlp)} on a mixture-of-experts model ({experts} experts): LoRA on the "
            "experts is not supported. Fix: --target-modules q_proj k_proj v_proj o_proj (attention only), or "
            "--exclude-modules gate_proj up_proj down_proj"
        )


def peft_target_modules(model: nn.Module, targets):
    """PEFT's ``target_modules``: the projection leaf names, or for a vision-language model a regex
    (PEFT full-matches a string against each module path) that leaves its vision tower out."""
    from rl_plugin.backends.fsdp.vision import tower_prefix, vision_model

    if vision_model(model) is None:
        return list(targets)
    return rf"^(?!{re.escape(tower_prefix(model))}\.).*\.(?:{'|'.join(targets)})$"


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int):
    """Wrap ``model`` (unsharded) in PEFT's LoRA and set our initial adapters; returns the
    ``PeftModel`` (its ``base_model.model`` is ``model``, modified in place)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = resolve_targets(cfg.target_modules, cfg.exclude_modules)
    refuse_experts(model, targets)
    peft_cfg = PeftLoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=peft_target_modules(model, targets),
    )
    peft_model = get_peft_model(model, peft_cfg)
    for param in model.parameters():
        param.requires_grad_(False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            m = _LORA_KEY.search(name)
            if m is None:
                continue
            canon = canonical_name(name)
            if m.group(1) == "A":
                param.copy_(initial_lora_a(canon, param.shape[0], param.shape[1], seed))
            else:
                param.zero_()
            param.requires_grad_(True)
    return peft_model


def load_adapter_dir(model: nn.Module, path: str) -> int:
    """``--lora-adapter-path``: copy a PEFT adapter directory's tensors into the (unsharded)
    adapters; every adapter must be there with its shape. Returns the tensors copied."""
    from safetensors.torch import load_file

    saved = {canonical_name(k): v for k, v in load_file(f"{path}/adapter_model.safetensors").items()}
    own = {canonical_name(n): p for n, p in model.named_parameters() if is_adapter_key(n)}
    missing = sorted(set(own) - set(saved))
    if missing:
        raise ValueError(
            f"--lora-adapter-path {path}: no tensor for {len(missing)} adapter(s) of this run (first {missing[0]}); "
            "the directory was saved with other --target-modules or for another model"
        )
    with torch.no_grad():
        for name, param in own.items():
            if tuple(saved[name].shape) != tuple(param.shape):
                raise ValueError(
                    f"--lora-adapter-path {path}: {name} has shape {tuple(saved[name].shape)}, this run's adapter "
                    f"{tuple(param.shape)} (check --lora-rank against the directory's adapter_config.json r)"
                )
            param.copy_(saved[name])
    return len(own)


def adapter_specs(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Canonical name -> meta tensor (global shape, fp32) of every adapter, in state-dict order."""
    return {
        canonical_name(k): torch.empty(v.shape, dtype=torch.float32, device="meta")
        for k, v in model.state_dict().items()
        if is_adapter_key(k)
    }


def stream_adapters(model: nn.Module, gather) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(canonical name, full fp32 CPU tensor)`` of every adapter on global rank 0 (the other
    ranks join each gather and get nothing); ``gather``: a DTensor -> full tensor on rank 0."""
    import torch.distributed as dist

    exporter = not dist.is_initialized() or dist.get_rank() == 0
    for name, value in model.state_dict().items():
        if not is_adapter_key(name):
            continue
        full = gather(value)
        if exporter:
            yield canonical_name(name), full.detach().to("cpu", torch.float32, copy=True).contiguous()
        del full


def merged_state_dict(state: Dict[str, torch.Tensor], scaling: float) -> Dict[str, torch.Tensor]:
    """A full PEFT-wrapped state dict (``base_layer`` + ``lora_A/B.default``) as the plain HF
    model's: each targeted ``W = W_base + scaling * B @ A`` (fp32), adapters dropped."""
    out = {}
    for key, value in state.items():
        if is_adapter_key(key):
            continue
        name = hf_name(key)
        if ".base_layer." in key and key.endswith(".weight"):
            module = key[: -len(".base_layer.weight")]
            a, b = state[f"{module}.lora_A.{ADAPTER}.weight"], state[f"{module}.lora_B.{ADAPTER}.weight"]
            value = value.float() + scaling * (b.float() @ a.float())
        out[name] = value
    return out
