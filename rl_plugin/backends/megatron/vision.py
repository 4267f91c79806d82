"""Qwen2.5-VL on the Megatron backend: mbridge's model on the local specs, images and M-RoPE per
micro-batch, the vision tower optionally frozen.

Model (``build_vl_model``): mbridge 0.15.1's ``Qwen2_5VLBridge`` with ``compat.mbridge_vl``'s
provider (local specs, the checkpoint's own vision sizes), building ``VLModel``: mbridge's
``Qwen2_5VLModel`` (vision tower ``vision_model`` with its merger ``vision_model.projection``,
and the language ``GPTModel`` ``language_model`` with M-RoPE) whose ``forward`` takes the
positions and image places from the caller instead of recomputing them (mbridge's forward runs
its own rope index with Qwen's hard-coded token ids and places image features at every image
token, responses included). mbridge loads the HF weights (``bridge.load_weights``) and exports
them (``save_weights`` / ``export_weights``), vision tower included.

Inputs (``image_kwargs``, called by ``forward.py`` for every micro-batch): the micro-batch's
``pixel_values`` / ``image_grid_thw`` (``StepBatch``, ``loss.batch``'s layout), the 3-D positions
of ``models.vl_positions.packed_positions`` (the prompt by transformers' own rope index on the
checkpoint's config, the response continuing linearly from the prompt's largest position + 1:
exactly FSDP's and the hf engine's positions) laid out like the 1-D positions (thd: the packed
stream ``[3, 1, t]``; bshd: ``[3, S, L]``, padding at 0), and ``image_mask`` (the prompt's image
tokens only). A micro-batch without images runs no vision tower (megatron-core's DDP reduces its
grad buffers whether a parameter got a gradient or not).

``--freeze-vision-tower`` (``freeze_vision_tower``): every parameter under ``vision_model`` (the
blocks, the patch embedding and the merger) gets ``requires_grad = False`` before DDP wraps the
model, so DDP gives it no grad buffer and the optimizer no state: its weights stay bitwise equal.

Not built (``check_vl_layout`` refuses at start-up): pipeline parallelism (the vision tower lives
on the first stage and its features would have to travel with the activations), context
parallelism (a sample's image tokens would be split over CP ranks), sequence parallelism (the
local specs' torch norms), LoRA and the true on-policy mode.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from mbridge.models.qwen2_5_vl.model import Qwen2_5VLModel
from megatron.core.transformer.enums import ModelType

from rl_plugin.errors import fail


class VLModel(Qwen2_5VLModel):
    """mbridge's Qwen2.5-VL with the caller's M-RoPE positions and image places (module docstring);
    ``model_type`` as GPTModel's (megatron-core's schedules read it; mbridge's class has none)."""

    model_type = ModelType.encoder_or_decoder

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        packed_seq_params=None,
        pixel_values: Optional[torch.Tensor] = None,
        image_grid_thw: Optional[torch.Tensor] = None,
        image_mask: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """``input_ids [b, s]``, ``position_ids [3, b, s]``; the image features of ``pixel_values``
        replace the embeddings at ``image_mask [b, s]`` (True: a prompt's image token), in order."""
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        if pixel_values is not None:
            features = self.vision_model(vision_data=pixel_values, grid_thw=image_grid_thw)
            places = image_mask.t().to(emb.device)  # [s, b]
            if int(places.sum()) != features.shape[0]:
                raise ValueError(
                    f"{int(places.sum())} image tokens in the prompts for {features.shape[0]} image features"
                )
            # the prompts' image tokens in [b, s] order are the features' order: scatter in that order
            order = places.t().reshape(-1).nonzero().squeeze(1)
            flat = emb.transpose(0, 1).reshape(-1, emb.shape[-1])
            flat = flat.index_put((order,), features.to(flat.dtype))
            emb = flat.view(emb.shape[1], emb.shape[0], -1).transpose(0, 1).contiguous()
        return self.language_model(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=emb,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )


def check_vl_layout(config) -> None:
    """The layouts ``build_vl_model`` does not run (module docstring), refused with the fix."""
    m = config.model
    refused = (
        (
            m.pipeline_model_parallel_size > 1,
            f"--pipeline-model-parallel-size {m.pipeline_model_parallel_size}",
            "use --pipeline-model-parallel-size 1",
        ),
        (
            m.context_parallel_size > 1,
            f"--context-parallel-size {m.context_parallel_size}",
            "use --context-parallel-size 1",
        ),
        (m.sequence_parallel, "--sequence-parallel", "drop --sequence-parallel"),
        (config.lora.enabled, "--lora-rank", "drop --lora-rank (full-model training)"),
        (config.true_on_policy, "--true-on-policy-mode", "drop --true-on-policy-mode"),
        (config.value_head, "a value model (--advantage-estimator ppo)", "use a group estimator (e.g. grpo)"),
    )
    for on, name, fix in refused:
        if on:
            fail(
                f"{name} with the vision-language checkpoint {m.hf_checkpoint}",
                "the Megatron backend trains Qwen2.5-VL at PP = CP = 1 without sequence parallelism, LoRA, "
                "the true on-policy mode or a critic (its vision tower runs whole on every rank)",
                f"{fix}, or use --train-backend fsdp",
            )


def make_vl_bridge(hf_dir: str, *, dtype: torch.dtype, extra_config: Optional[Dict] = None):
    """mbridge's Qwen2.5-VL bridge on the local specs (``compat.mbridge_vl``), building ``VLModel``."""
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_vl import vl_bridge_class

    hf_config = AutoConfig.from_pretrained(hf_dir)
    if hf_config.model_type not in ("qwen2_5_vl",):
        raise ValueError(
            f"--hf-checkpoint {hf_dir}: the vision-language family {hf_config.model_type!r} is not built on the "
            "Megatron backend (Qwen2.5-VL is). Fix: --train-backend fsdp"
        )
    bridge = vl_bridge_class(_MODEL_REGISTRY["qwen2_5_vl"], VLModel)(hf_config, dtype=dtype)
    if extra_config:
        bridge.set_extra_args(**extra_config)
    return bridge


def build_vl_chunks(bridge) -> list:
    """The one model chunk (PP = 1, ``check_vl_layout``), knowing its HF config (``image_kwargs``)."""
    model = bridge._model_provider([])(pre_process=True, post_process=True)
    model.rl_hf_config = bridge.hf_config
    return [model]


def freeze_vision_tower(chunks) -> None:
    """``--freeze-vision-tower``: the vision tower and its merger out of training (module docstring)."""
    for chunk in chunks:
        if getattr(chunk, "vision_model", None) is not None:
            for p in chunk.vision_model.parameters():
                p.requires_grad_(False)


def vision_core(model) -> Optional[VLModel]:
    """The ``VLModel`` inside the DDP / Float16Module wrappers, or None (a text model)."""
    while hasattr(model, "module"):
        model = model.module
    return model if isinstance(model, VLModel) else None


_ROPE: Dict[int, object] = {}  # id(hf config) -> RopeIndex


def image_kwargs(model, mb, device) -> Optional[Dict[str, torch.Tensor]]:
    """``{"position_ids", "pixel_values", "image_grid_thw", "image_mask"}`` of the micro-batch in the
    layout of ``mb.input_ids`` (module docstring), None for a text model. Without images: the 3-D
    positions only."""
    from rl_plugin.models.vl_positions import RopeIndex, packed_positions

    core = vision_core(model)
    if core is None:
        return None
    batch, layout = mb.batch, mb.layout
    hf_config = core.rl_hf_config
    rope = _ROPE.setdefault(id(hf_config), RopeIndex(hf_config))
    stream = packed_positions(rope, batch)
    index, pad = layout.input_index.clamp(min=0), layout.input_index < 0
    shape = mb.input_ids.shape if mb.input_ids.dim() == 2 else (1, mb.input_ids.numel())
    out = {"position_ids": stream["positions"][:, index].masked_fill(pad, 0).view(3, *shape).to(device)}
    if batch.image_counts is not None and int(batch.image_counts.sum()) > 0:
        out.update(
            pixel_values=batch.pixel_values.to(device),
            image_grid_thw=batch.image_grid_thw.to(device),
            image_mask=stream["image_mask"][index].masked_fill(pad, False).view(shape),
        )
    return out
