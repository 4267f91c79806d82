"""Images through the vLLM engine (Qwen2-VL / Qwen2.5-VL checkpoints, ``--multimodal-keys``).

A prompt with images (``rollout.data.vl_prompt.ImagePrompt``) holds our processor's expanded ids:
each image's ``<|image_pad|>`` repeated ``prod(grid_thw) / merge**2`` times. vLLM expands
placeholders itself, so its request carries the ids with each image's run collapsed back to one
``<|image_pad|>`` (``collapsed_ids``), the opened images (``multi_modal_data={"image": [...]}``) and
the cache salt; vLLM's processor (the run's ``--min-pixels`` / ``--max-pixels`` given to it as
``mm_processor_kwargs``, ``engine_kwargs``) expands them again, and the expanded prompt vLLM ran
must equal ours token for token (``check_expanded``: a different image-token count would shift
every position the trainer scores): else the call fails naming the sample and both counts. The
sample keeps our ids, the ones the trainer uses.

vLLM's Qwen2-VL model module imports transformers' torchvision image processor, and its processor
loader builds the video processor with torchvision; the CPU install has no torchvision
(``scripts/setup_env.sh``). ``processors_without_torchvision`` (run in the engine process before
vLLM loads the model, only where torchvision is missing) gives that import the PIL image
processor's module, makes ``Qwen2(_5)_VLProcessor.from_pretrained`` build the processor the way
``models.vl_processor`` does (PIL image processor, pixel bounds, no video processor: ``NoVideos``
refuses any video, and the engine allows none per prompt), and registers the two model classes
with vLLM so their inspection runs in this process rather than in a fresh one without the shim.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Dict, List, Optional, Sequence

MAX_IMAGES_PER_PROMPT = 8  # vLLM's limit_mm_per_prompt: a prompt with more is refused by vLLM, naming it


def has_images(prompt) -> bool:
    return getattr(prompt, "images", None) is not None and getattr(prompt, "pixel_values", None) is not None


def engine_kwargs(min_pixels: Optional[int], max_pixels: Optional[int]) -> Dict:
    """``LLM`` arguments of a vision-language checkpoint (which also loads its tokenizer: vLLM's
    multimodal processor needs it): at most ``MAX_IMAGES_PER_PROMPT`` images and no video per prompt, the run's pixel
    bounds for vLLM's image processor (None: the checkpoint's)."""
    bounds = {k: int(v) for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    return {
        "limit_mm_per_prompt": {"image": MAX_IMAGES_PER_PROMPT, "video": 0},
        **({"mm_processor_kwargs": bounds} if bounds else {}),
    }


def collapsed_ids(prompt, image_token_id: int) -> List[int]:
    """``prompt``'s ids with each image's run of ``image_token_id`` collapsed to one token (what
    vLLM's processor expands); the runs must be one per image."""
    places = getattr(prompt, "mm_token_type_ids", None)
    if places is not None:
        stray = [j for j, (t, m) in enumerate(zip(prompt, places)) if t == image_token_id and not m]
        if stray:
            raise ValueError(
                f"the prompt holds an image token the model sampled (position {stray[0]}, not an image's place; "
                f"{len(stray)} in all), and vLLM expands every image token of a prompt as an image's placeholder, so "
                "this history cannot be sent to vLLM. Fix: use --rollout-engine hf for multi-turn hooks whose turns "
                "may sample the image token (it treats a sampled one as text), or end the sample at that turn"
            )
    out: List[int] = []
    runs = 0
    for t in prompt:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        runs += t == image_token_id
        out.append(t)
    if runs != len(prompt.images):
        raise ValueError(
            f"a prompt holds {runs} runs of image tokens for {len(prompt.images)} images: two images' tokens are adjacent "
            "(no <|vision_start|>/<|vision_end|> between them), so vLLM cannot tell them apart; use the processor's template"
        )
    return out


def request(prompt, image_token_id: int, salt: str, extra: Sequence[int] = ()) -> Dict:
    """vLLM's request for ``prompt`` (+ ``extra`` ids generated so far): plain ids for a text
    prompt, the collapsed ids and the images for one with images."""
    if not has_images(prompt):
        return {"prompt_token_ids": list(prompt) + list(extra), "cache_salt": salt}
    return {
        "prompt_token_ids": collapsed_ids(prompt, image_token_id) + list(extra),
        "multi_modal_data": {"image": list(prompt.images)},
        "cache_salt": salt,
    }


def check_expanded(index: int, prompt, engine_ids: Sequence[int], image_token_id: int) -> None:
    """vLLM's expanded prompt must be ours (module docstring)."""
    if list(engine_ids) == list(prompt):
        return
    ours = sum(t == image_token_id for t in prompt)
    theirs = sum(t == image_token_id for t in engine_ids)
    raise RuntimeError(
        f"sample {index}: vLLM expanded the prompt's images into {theirs} image tokens ({len(engine_ids)} prompt tokens), "
        f"the rollout's processor into {ours} ({len(prompt)} tokens): the trainer would score other positions. vLLM's "
        "processor must resize as ours does: give both the same --min-pixels / --max-pixels (the engine passes them "
        "as mm_processor_kwargs)"
    )


class NoVideos:
    """The video processor of a processor built without torchvision: vLLM reads the names of its
    arguments; videos are never sent (``limit_mm_per_prompt`` allows none)."""

    from transformers.processing_utils import VideosKwargs as valid_kwargs

    def __call__(self, *args, **kwargs):
        raise RuntimeError("videos need torchvision, which this install lacks; rl_plugin reads images only")


def processors_without_torchvision() -> None:
    """Let vLLM's Qwen2(.5)-VL model module and processor load without torchvision (module
    docstring); nothing where torchvision is installed. Idempotent."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name not in sys.modules:
        shim = types.ModuleType(name)
        shim.smart_resize = pil.smart_resize
        shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        shim.__all__ = ["Qwen2VLImageProcessor", "smart_resize"]
        sys.modules[name] = shim
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    from rl_plugin.models.vl_processor import processor_without_video, with_pixel_bounds

    def from_pretrained(cls, path, *args, min_pixels=None, max_pixels=None, **kwargs):
        proc = with_pixel_bounds(processor_without_video(path), min_pixels=min_pixels, max_pixels=max_pixels)
        proc.video_processor = NoVideos()
        return proc

    for cls in (Qwen2VLProcessor, Qwen2_5_VLProcessor):
        cls.from_pretrained = classmethod(from_pretrained)
    # vLLM inspects a lazily registered architecture in a fresh subprocess (no shim there):
    # registered as classes, they are inspected here
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    for model_cls in (Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration):
        ModelRegistry.register_model(model_cls.__name__, model_cls)
