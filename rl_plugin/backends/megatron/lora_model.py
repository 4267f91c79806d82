"""LoRA on a megatron-core GPTModel: where the adapters go, what is frozen, how they are read and
written (issue 34). The adapter math is ``lora.py``'s; the export stream ``lora_export.py``'s.

- ``check_lora_supported(model_cfg, lora_cfg, ...)``: the layouts it refuses, by name (sequence
  parallelism, context parallelism, mixture-of-experts models) before anything is built.
- ``apply_lora(chunks, lora_cfg, seed)``: every parameter of the chunks frozen
  (``requires_grad_(False)``), then each targeted linear of each decoder layer becomes its
  ``Lora*ParallelLinear`` (the same object, its class swapped, ``self.lora`` added), A from
  ``rl_plugin.lora.init.initial_lora_a`` of the canonical name, sliced for this TP rank. Called
  after the HF weights are loaded and BEFORE ``Float16Module`` / megatron DDP / the optimizer,
  so frozen weights get no grad buffer and no optimizer state (DDP and ``get_megatron_optimizer``
  skip parameters without ``requires_grad``). Each decoder layer uses its global number
  (``layer_number - 1``), so every pipeline stage (and virtual stage) adapts its own layers.
- ``adapters_disabled(model)``: the base model's forward (the KL reference: the frozen base IS the
  reference, so no second copy of the model is built).
- ``base_view(model, merged=...)``: for the export code written for the full model (mbridge's
  conversion, ``bridge.stream_hf``, ``pipeline_export``, ``save_weights``): the adapter modules
  are detached from their linears for the block, so the model's parameters are the base's under
  their usual names; ``merged=True`` also shows each adapted weight as ``W + s B A`` (the weight
  tensor swapped for a merged copy and the original put back after, bitwise).
- ``load_adapters(model, tensors)``: full canonical tensors (e.g. a PEFT file) into the local
  shards.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from rl_plugin.backends.megatron.chunks import chunks_of
from rl_plugin.backends.megatron.lora import LORA_CLASSES, AdapterSpec, FusedLayout, LoraAdapters
from rl_plugin.lora.names import hf_module_path, lora_a_name, lora_b_name
from rl_plugin.lora.targets import MEGATRON_FUSED, megatron_targets, resolve_targets


class LoraSetupError(ValueError):
    """A layout LoRA on the Megatron backend cannot run; the message names the flag and the fix."""


def check_lora_supported(model_cfg, lora_cfg, *, num_experts: int) -> None:
    """Fail loud on what the Megatron LoRA does not cover (before any group or model is built)."""
    if not lora_cfg.enabled:
        return
    if model_cfg.sequence_parallel:
        raise LoraSetupError(
            "--lora-rank with --sequence-parallel: the Megatron LoRA adapters take the linears' input whole on every "
            "TP rank and are not written for sequence-split activations. Fix: drop --sequence-parallel."
        )
    if model_cfg.context_parallel_size > 1:
        raise LoraSetupError(
            f"--lora-rank with --context-parallel-size {model_cfg.context_parallel_size}: LoRA builds the local layer "
            "spec (megatron-core's own linears; transformer-engine's fused LayerNormLinear hides the normalised "
            "input the adapter needs), and context parallelism needs transformer-engine attention. Fix: "
            "--context-parallel-size 1."
        )
    if num_experts:
        raise LoraSetupError(
            f"--lora-rank with the mixture-of-experts model {model_cfg.hf_checkpoint}: LoRA on experts (and on an MoE "
            "model's attention alone) is not implemented on the Megatron backend. Fix: a dense model, or "
            "--train-backend fsdp."
        )


def _layout(config, mcore_name: str, tp: int) -> FusedLayout:
    """The local output layout of a megatron linear at TP ``tp`` (``lora.FusedLayout``)."""
    if mcore_name == "linear_qkv":
        groups = config.num_query_groups
        q = config.kv_channels * config.num_attention_heads // groups
        return FusedLayout(groups // tp, (q, config.kv_channels, config.kv_channels))
    if mcore_name == "linear_fc1":
        return FusedLayout(1, (config.ffn_hidden_size // tp,) * 2)
    return FusedLayout(1, (config.hidden_size,))  # linear_proj, linear_fc2: row-parallel, output whole


def _full_shapes(config, projection: str) -> Tuple[int, int]:
    """``(out, in)`` of an HF projection, from the megatron config."""
    h, kv, ffn = config.hidden_size, config.kv_channels, config.ffn_hidden_size
    q_out = kv * config.num_attention_heads
    return {
        "q_proj": (q_out, h),
        "k_proj": (kv * config.num_query_groups, h),
        "v_proj": (kv * config.num_query_groups, h),
        "o_proj": (h, q_out),
        "gate_proj": (ffn, h),
        "up_proj": (ffn, h),
        "down_proj": (h, ffn),
    }[projection]


def _linear(layer, mcore_name: str):
    block = layer.self_attention if mcore_name in ("linear_qkv", "linear_proj") else layer.mlp
    return getattr(block, mcore_name, None)


def decoder_layers(core) -> list:
    decoder = getattr(core, "decoder", None)
    return list(decoder.layers) if decoder is not None else []


def apply_lora(chunks, lora_cfg, *, seed: int) -> int:
    """Freeze the chunks and add the adapters (module docstring); returns this rank's adapter
    parameter count (local shards)."""
    from megatron.core import parallel_state as mpu

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    targets = megatron_targets(resolve_targets(lora_cfg.target_modules, lora_cfg.exclude_modules))
    count = 0
    for core in chunks:
        core.requires_grad_(False)
        for layer in decoder_layers(core):
            index = layer.layer_number - 1  # global layer number (pipeline / virtual stage offset included)
            for mcore_name, projections in targets.items():
                linear = _linear(layer, mcore_name)
                cls = LORA_CLASSES.get(type(linear))
                if cls is None:
                    raise LoraSetupError(
                        f"--target-modules {mcore_name}: layer {index}'s {mcore_name} is {type(linear).__name__}, not "
                        "megatron-core's ColumnParallelLinear / RowParallelLinear (the local layer spec LoRA builds). "
                        "Fix: leave it out with --exclude-modules."
                    )
                if getattr(linear, "gather_output", False):
                    raise LoraSetupError(f"LoRA: layer {index}'s {mcore_name} gathers its output; not supported")
                config = linear.config
                layout = _layout(config, mcore_name, tp_size)
                order = MEGATRON_FUSED[mcore_name]
                specs = []
                for projection in projections:
                    path = hf_module_path(index, projection)
                    out_f, in_f = _full_shapes(config, projection)
                    specs.append(
                        AdapterSpec(
                            projection, lora_a_name(path), lora_b_name(path), order.index(projection), in_f, out_f
                        )
                    )
                adapters = LoraAdapters(
                    specs,
                    layout,
                    parallel="column" if issubclass(cls, ColumnParallelLinear) else "row",
                    rank=lora_cfg.lora_rank,
                    alpha=lora_cfg.lora_alpha,
                    dropout=lora_cfg.lora_dropout,
                    seed=seed,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    tp_group=linear.tp_group,
                    dtype=linear.weight.dtype,
                    device=linear.weight.device,
                )
                linear.__class__ = cls  # the same module (weights, hooks, names), plus the adapter's forward
                linear.add_module("lora", adapters)
                count += sum(p.numel() for p in adapters.parameters())
    return count


def adapter_modules(model) -> List[LoraAdapters]:
    """Every ``LoraAdapters`` of this rank's chunks, in chunk then layer order."""
    return [m for chunk in chunks_of(model) for m in chunk.modules() if isinstance(m, LoraAdapters)]


def _adapted_linears(model) -> list:
    cls = tuple(LORA_CLASSES.values())
    return [m for chunk in chunks_of(model) for m in chunk.modules() if isinstance(m, cls)]


def has_lora(model) -> bool:
    return bool(adapter_modules(model))


def local_adapters(model) -> List[Tuple[str, torch.nn.Parameter, LoraAdapters, str]]:
    """``(canonical name, local parameter, its LoraAdapters, "A"/"B")`` in export order."""
    return [(name, p, m, which) for m in adapter_modules(model) for name, p, which in m.named_adapters()]


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model's forward inside the block."""
    modules = adapter_modules(model)
    saved = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, was in zip(modules, saved):
            m.enabled = was


@contextlib.contextmanager
def base_view(model, *, merged: bool):
    """The model as the full-model export code expects it (module docstring). The swapped
    weight is frozen (no DDP buffer, no optimizer state), so nothing else holds its storage."""
    linears = [m for m in _adapted_linears(model) if "lora" in m._modules]  # re-entrant: an outer view holds the rest
    saved = []
    try:
        with torch.no_grad():
            for linear in linears:
                adapters = linear._modules.pop("lora")
                weight = linear.weight.data
                saved.append((linear, adapters, weight))
                if merged:
                    linear.weight.data = (weight.float() + adapters.delta_weight()).to(weight.dtype)
        yield
    finally:
        for linear, adapters, weight in saved:
            linear.weight.data = weight
            linear._modules["lora"] = adapters


def stream_in_view(model, stream_fn, *, merged: bool) -> Iterator:
    """``stream_fn()``'s items with ``base_view`` held from the first ``next`` until the stream is
    exhausted or closed (no forward runs while an export streams)."""
    with base_view(model, merged=merged):
        yield from stream_fn()


def load_adapters(model, tensors: Dict[str, torch.Tensor], *, strict: bool = True) -> int:
    """Copy full canonical adapter tensors into this rank's shards; returns how many were set.
    ``strict``: every local adapter must be given, with its full shape."""
    count = 0
    with torch.no_grad():
        for name, param, module, which in local_adapters(model):
            full = tensors.get(name)
            if full is None:
                if strict:
                    raise KeyError(f"LoRA adapters: {name} is missing from the adapters to load")
                continue
            spec = next(s for s in module.specs if name in (s.a_name, s.b_name))
            want = (module.rank, spec.in_features) if which == "A" else (spec.out_features, module.rank)
            if tuple(full.shape) != want:
                raise ValueError(f"LoRA adapters: {name} is {tuple(full.shape)}, this model's is {want} (rank, shape)")
            param.copy_(module.local_slice(full, which).to(param.dtype))
            count += 1
    return count
