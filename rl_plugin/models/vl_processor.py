"""A vision-language checkpoint's processor and what it makes of one prompt (Qwen2-VL family).

``load_vl_processor(dir)`` is ``AutoProcessor.from_pretrained(dir)`` where that works. transformers
5 builds a Qwen2(.5)-VL processor's *video* processor with torchvision; on an install without
torchvision (this project's CPU install: nothing else needs it) it builds the same processor class
from the checkpoint's tokenizer, image processor (the PIL backend) and chat template, with no video
processor: images work, videos are refused. ``min_pixels`` / ``max_pixels`` override the image
processor's (``--min-pixels`` / ``--max-pixels``, the processor's names).

``encode(processor, text, images)``: the processor's expanded ids (each ``<|image_pad|>`` becomes
the image's ``prod(grid_thw) / merge**2`` tokens), ``pixel_values`` ``[sum patches, C*T*P*P]`` and
``image_grid_thw`` ``[num_images, 3]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

import torch

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


def checkpoint_model_type(checkpoint_dir) -> Optional[str]:
    """``model_type`` of ``checkpoint_dir/config.json`` (None without one)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("model_type")


def has_vision_config(checkpoint_dir) -> bool:
    """Whether ``config.json`` declares a vision tower (a ``vision_config``), whatever the family."""
    path = Path(checkpoint_dir) / "config.json"
    return path.exists() and "vision_config" in json.loads(path.read_text())


def is_vl_checkpoint(checkpoint_dir) -> bool:
    """Whether the checkpoint is a vision-language model this project runs (``VL_MODEL_TYPES``)."""
    return checkpoint_model_type(checkpoint_dir) in VL_MODEL_TYPES


def auto_model_class(checkpoint_dir):
    """The transformers auto class that builds the checkpoint's model: ``AutoModelForImageTextToText``
    for a vision-language one (``VL_MODEL_TYPES``), else ``AutoModelForCausalLM``."""
    import transformers

    vl = is_vl_checkpoint(checkpoint_dir)
    return transformers.AutoModelForImageTextToText if vl else transformers.AutoModelForCausalLM


def load_vl_processor(checkpoint_dir, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None):
    """The checkpoint's processor (module docstring), with the pixel bounds applied."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(checkpoint_dir)
    except ImportError:  # no torchvision: the video processor cannot be built
        proc = processor_without_video(checkpoint_dir)
    return with_pixel_bounds(proc, min_pixels=min_pixels, max_pixels=max_pixels)


def with_pixel_bounds(processor, *, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None):
    """``processor`` with its image processor's resize bounds set (None: the bound it has)."""
    if min_pixels is not None or max_pixels is not None:
        low, high = pixel_bounds(processor)
        size = {"shortest_edge": low if min_pixels is None else min_pixels}
        size["longest_edge"] = high if max_pixels is None else max_pixels
        processor.image_processor.size = type(processor.image_processor.size)(**size)
    return processor


def pixel_bounds(processor) -> Tuple[int, int]:
    """``(min_pixels, max_pixels)`` of the processor's image resize (its ``size`` entries)."""
    size = processor.image_processor.size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def processor_without_video(checkpoint_dir):
    """``Qwen2_5_VLProcessor`` (or Qwen2-VL's) built from its parts, no video processor.

    ``ProcessorMixin.__init__`` type-checks every attribute against classes that only exist with
    torchvision, so the instance is made with ``__new__`` and given the attributes its ``__init__``
    sets (tokenizer, image processor, chat template, image/video token and id)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor

    cls = Qwen2_5_VLProcessor if checkpoint_model_type(checkpoint_dir) == "qwen2_5_vl" else Qwen2VLProcessor
    tok = AutoTokenizer.from_pretrained(checkpoint_dir)
    proc = object.__new__(cls)
    proc.tokenizer = tok
    proc.image_processor = AutoImageProcessor.from_pretrained(checkpoint_dir)
    proc.video_processor = None
    template = Path(checkpoint_dir) / "chat_template.jinja"
    proc.chat_template = template.read_text() if template.exists() else getattr(tok, "chat_template", None)
    proc.image_token = getattr(tok, "image_token", None) or "<|image_pad|>"
    proc.video_token = getattr(tok, "video_token", None) or "<|video_pad|>"
    proc.image_token_id = tok.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(proc.video_token)
    return proc


def encode(processor, text: str, images: List) -> Tuple[List[int], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(ids, pixel_values, image_grid_thw)`` of one prompt ``text`` holding one image
    placeholder per image of ``images`` (PIL images), in order; ``None`` tensors without images."""
    out = processor(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not images:
        return ids, None, None
    return ids, out["pixel_values"], out["image_grid_thw"]


def image_token_count(processor, width: int, height: int) -> int:
    """The image tokens an image of ``width`` x ``height`` becomes (after the processor's resize
    to its pixel bounds): ``prod(grid_thw) / merge**2``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ip = processor.image_processor
    factor = ip.patch_size * ip.merge_size
    low, high = pixel_bounds(processor)
    h, w = smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)
    return (h // factor) * (w // factor)
