"""A vision-language micro-batch's extra model inputs on the FSDP backend (Hugging Face Qwen2-VL /
Qwen2.5-VL): the images, M-RoPE positions per sample, and the image tokens (prompt and tool turns).

``image_inputs(model, mb)`` (``mb.batch``: the micro-batch's ``StepBatch``, images in
``loss.batch``'s layout) returns, for a vision-language model, ``pixel_values`` /
``image_grid_thw`` of the micro-batch's images, ``positions`` ``[3, *input_ids.shape]`` and
``image_mask`` (``input_ids.shape``, bool), both in the layout of ``mb.input_ids`` (thd: the
packed stream; bshd: ``[S, L]``), which ``packing.model_inputs`` then lays out as it lays out the
1-D positions. None for a text model.

Positions: each sample (prompt and response) gets the model's own 3-D rope index
(``get_rope_index``: text positions count 1 per token, an image's tokens its (t, h, w) grid from
the position after the text before it, the text after an image resumes at ``max + 1``) over its
image tokens: the prompt's ``<|image_pad|>`` ids and the response's with loss mask 0 (an image a
hook appended in a tool turn, ``rollout.vl_turns``). That is what the engine used: ``generate``
decodes from the prefill's largest position + 1, one per token (its ``rope_deltas``), which is
the rope index of text after the last image, and each later turn re-prefills the whole history
with its image tokens marked. An image token the engine sampled in a response (loss mask 1) is an
ordinary text position, as it was for the engine. ``image_mask`` marks the same image tokens: the
image embeddings are scattered there (``placeholders``, which replaces the model's
``get_placeholder_mask`` for the call: the model's own would count a sampled image token too).
The loss mask keeps the image tokens out of the loss. Samples are independent: one padded
``get_rope_index`` call per micro-batch, rows masked by their lengths.

Every forward of a vision-language model runs its vision tower once (FSDP2's all-gathers and
reduce-scatters are collective: a DP rank whose micro-batch has no image, or an idle pass, must run
the same vision blocks): such a pass gets one blank 1 x 2 x 2-patch image with no place to go, and
``VisionTouch`` adds 0 x its output to the micro-batch's result, so its gradients (zero) reach the
reduce-scatter like every rank's. Context parallelism is refused for images (``check_images``).

``--freeze-vision-tower`` (``freeze_tower``, before ``fully_shard``): every parameter of the
tower (``visual.*``: patch embedding, blocks, patch merger) gets ``requires_grad = False``, so no
gradient is computed or reduced for it, the optimizer holds no state for it, the grad norm and
clipping cover the trainable parameters only, and its weights stay bitwise as loaded. The tower
still runs in every pass (forward all-gathers are collective); its output then needs no gradient.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional

import torch

from rl_plugin.models.vl_positions import packed_positions

_FOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its vision module (or None)


def vision_model(model):
    """The module holding the rope index and the placeholder mask (``Qwen2_5_VLModel``), or None
    for a text model (looked up once per model: every micro-batch asks)."""
    if model not in _FOUND:
        found = (
            m
            for m in model.modules()
            if hasattr(type(m), "get_rope_index") and hasattr(type(m), "get_placeholder_mask")
        )
        _FOUND[model] = next(found, None)
    return _FOUND[model]


def tower_prefix(model) -> str:
    """The module path of the vision tower (``model.visual`` in Qwen2.5-VL's HF layout)."""
    inner = vision_model(model)
    if inner is None:
        raise ValueError(f"{type(model).__name__} has no vision tower (is --hf-checkpoint a vision-language model?)")
    return next(name for name, module in model.named_modules() if module is inner.visual)


def freeze_tower(model) -> int:
    """``--freeze-vision-tower``: the tower's parameters stop training; returns how many elements."""
    prefix = tower_prefix(model) + "."
    frozen = 0
    for name, param in model.named_parameters():
        if name.startswith(prefix):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def check_images(layout) -> None:
    """Images need the whole sample on the rank (CP splits a sample's image tokens)."""
    if layout.cp_size > 1:
        raise ValueError(
            "--context-parallel-size > 1 with images: the fsdp backend does not split a sample's image tokens "
            "over CP ranks. Fix: --context-parallel-size 1"
        )


def image_inputs(model, mb) -> Optional[Dict[str, torch.Tensor]]:
    """The micro-batch's vision inputs (module docstring), or None for a text model."""
    inner = vision_model(model)
    if inner is None:
        return None
    batch, layout = mb.batch, mb.layout
    check_images(layout)
    blank = layout.num_samples == 0 or batch.image_counts is None or int(batch.image_counts.sum()) == 0
    if blank:
        images = _blank(inner)
    else:
        images = {"pixel_values": batch.pixel_values, "image_grid_thw": batch.image_grid_thw}
    if layout.num_samples == 0:
        return images
    stream = packed_positions(inner, batch)  # [3, sum T_i], [sum T_i]: shared with the Megatron backend
    index, pad = layout.input_index.clamp(min=0), layout.input_index < 0
    shape = mb.input_ids.shape
    positions = stream["positions"][:, index].masked_fill(pad, 0).view(3, *shape)
    mask = stream["image_mask"][index].masked_fill(pad, False).view(shape)
    return {**images, "positions": positions, "image_mask": None if blank else mask}  # blank: placed nowhere


def _blank(inner) -> Dict[str, torch.Tensor]:
    """One black 2 x 2-patch image (the smallest the merger takes), placed nowhere."""
    vc = inner.config.vision_config
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    merge = vc.spatial_merge_size
    return {
        "pixel_values": torch.zeros(merge * merge, width),
        "image_grid_thw": torch.tensor([[1, merge, merge]]),
        "image_mask": None,
    }


class VisionTouch:
    """Within ``placeholders``: the vision tower's output of the call, for ``touch``."""

    def __init__(self):
        self.output: Optional[torch.Tensor] = None

    def touch(self, result: torch.Tensor) -> torch.Tensor:
        """``result + 0 * sum(vision output)``: the tower in the graph of every pass (module docstring)."""
        if self.output is None or not torch.is_grad_enabled():
            return result
        return result + 0.0 * self.output.sum().to(result.dtype)


@contextlib.contextmanager
def placeholders(model, image_mask: Optional[torch.Tensor]):
    """Within the block, the model's image places are ``image_mask`` (None: none at all), and the
    vision tower's output is kept for ``VisionTouch.touch``; yields the ``VisionTouch``."""
    inner = vision_model(model)
    seen = VisionTouch()

    def places(input_ids, inputs_embeds, image_features=None, video_features=None):
        mask = torch.zeros(inputs_embeds.shape[:-1], dtype=torch.bool, device=inputs_embeds.device)
        if image_mask is not None:
            mask = image_mask.to(inputs_embeds.device).view(mask.shape)
        if image_features is not None and image_mask is not None and int(mask.sum()) != image_features.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} image tokens in the samples for {image_features.shape[0]} image features"
            )
        full = mask.unsqueeze(-1).expand_as(inputs_embeds)
        return full, torch.zeros_like(full)

    def keep(module, args, output):
        seen.output = output.pooler_output if hasattr(output, "pooler_output") else output[0]

    inner.get_placeholder_mask = places  # an instance attribute: this call only (removed below)
    handle = inner.visual.register_forward_hook(keep)
    try:
        yield seen
    finally:
        del inner.get_placeholder_mask
        handle.remove()
