"""Prompts with images: a record's text and images as the vision-language processor makes them.

``VLPrompts`` is the rollout tokenizer of a ``--multimodal-keys`` run (``rollout_prompts``):
the text adapter (``HFTokenizerAdapter``: chat template, system prompt, template kwargs) over the
checkpoint's processor (``models.vl_processor``). ``image_prompt(prompt, images)`` places one
image placeholder per image and lets the processor expand it:

- a text prompt: each ``<image>`` marker (verl's convention) is an image's place, in order;
  without markers the images come first. With ``--apply-chat-template`` the prompt becomes a user
  turn whose content parts are the images and the text between them; without, the marker becomes
  the processor's placeholder (``<|vision_start|><|image_pad|><|vision_end|>``) in the raw text;
- chat messages: their image content parts (``{"type": "image"}``) are the places, in order;
  a string content's ``<image>`` markers count too.

The number of places must equal the number of images (a ``PromptFormatError`` otherwise: the
preflight names the record's ``file:line``). The result is an ``ImagePrompt``: the processor's
expanded ids (a ``list``: every path that takes a prompt's ids takes it), with ``pixel_values``
``[patches, C*T*P*P]``, ``image_grid_thw`` ``[images, 3]`` and ``mm_token_type_ids`` (1 at an image
token) attached, and the opened ``images``.
"""

from __future__ import annotations

from typing import Any, Dict, List

from rl_plugin.models.vl_processor import encode, is_vl_checkpoint, load_vl_processor
from rl_plugin.rollout.data.tokenizer import HFTokenizerAdapter, PromptFormatError, rollout_tokenizer

MARKER = "<image>"


class ImagePrompt(list):
    """A prompt's ids (``list`` of int) carrying its images' processed tensors: ``pixel_values``,
    ``image_grid_thw`` and the opened ``images`` (what a reward receives in
    ``sample.multimodal_inputs``). Pickles with its attributes (Ray's transport to engine actors)."""

    def __init__(self, ids, pixel_values, image_grid_thw, images, image_token_id: int, mm_token_type_ids=None):
        super().__init__(ids)
        self.pixel_values, self.image_grid_thw, self.images = pixel_values, image_grid_thw, images
        # 1 at an image token: every <|image_pad|> of a prompt; a later turn's request marks its own
        # (``rollout.vl_turns.image_token_mask``: one the model sampled is text)
        self.mm_token_type_ids = (
            [int(i == image_token_id) for i in ids] if mm_token_type_ids is None else list(mm_token_type_ids)
        )


class VLPrompts(HFTokenizerAdapter):
    """The rollout tokenizer of a run with images (module docstring)."""

    def __init__(self, processor, **chat):
        super().__init__(processor.tokenizer, **chat)
        self.processor = processor
        ip = processor.image_processor
        self.placeholder = "<|vision_start|>" + processor.image_token + "<|vision_end|>"
        self.merge = ip.merge_size

    def image_messages(self, prompt) -> List[Dict[str, Any]]:
        """The chat of ``prompt`` with each image's place an ``{"type": "image"}`` part."""
        msgs = self.messages(prompt)
        return [{**m, "content": _parts(m["content"])} for m in msgs]

    def image_text(self, prompt) -> str:
        """The prompt's text with one placeholder per image place (before the processor expands it)."""
        if self.apply_chat_template:
            msgs = self.image_messages(prompt)
            return self.processor.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        if not isinstance(prompt, str):
            raise PromptFormatError(
                "the prompt is a list of chat messages, which only a chat template turns into tokens",
                "pass --apply-chat-template (or give the prompt as a string)",
            )
        return prompt.replace(MARKER, self.placeholder)

    def prompt_text(self, prompt) -> str:
        """``sample.prompt``: the text with one placeholder per marked image place (unexpanded)."""
        return self.image_text(prompt)

    def image_prompt(self, prompt, images: List[Any]) -> ImagePrompt:
        """``prompt`` with its opened ``images`` (PIL) as the processor encodes it (module docstring)."""
        if isinstance(prompt, str) and MARKER not in prompt:
            prompt = MARKER * len(images) + prompt  # no marker: the images first
        text = self.image_text(prompt)
        places = text.count(self.placeholder)
        if places != len(images):
            raise PromptFormatError(
                f"the prompt marks {places} image places (<image> markers or image content parts) for {len(images)} images",
                "mark each image once, in order (or no marker in a text prompt: the images go first)",
            )
        ids, pixels, grid = encode(self.processor, text, images)
        return ImagePrompt(ids, pixels, grid, images, self.processor.image_token_id)


def _parts(content) -> List[Dict[str, Any]]:
    """A message content as parts: a string's ``<image>`` markers become image parts."""
    if isinstance(content, list):
        return content
    out: List[Dict[str, Any]] = []
    for k, piece in enumerate(content.split(MARKER)):
        if k:
            out.append({"type": "image"})
        if piece:
            out.append({"type": "text", "text": piece})
    return out


def vl_prompts(config, checkpoint_dir) -> VLPrompts:
    """The rollout tokenizer of a ``--multimodal-keys`` run: ``checkpoint_dir``'s processor at the
    run's pixel bounds; a text-only checkpoint is refused naming the flag."""
    mm = config.multimodal
    if not is_vl_checkpoint(checkpoint_dir):
        raise ValueError(
            f"--multimodal-keys with --hf-checkpoint {checkpoint_dir}: that checkpoint is a text-only model (no vision "
            "tower: its config.json is no Qwen2-VL / Qwen2.5-VL). Fix: pass a vision-language checkpoint (e.g. "
            "`python -m rl_plugin.models.tiny_vl DIR`), or drop --multimodal-keys"
        )
    processor = load_vl_processor(checkpoint_dir, min_pixels=mm.min_pixels, max_pixels=mm.max_pixels)
    return VLPrompts(
        processor,
        apply_chat_template=config.apply_chat_template,
        chat_template_kwargs=config.apply_chat_template_kwargs,
        system_prompt=config.system_prompt,
    )


def rollout_prompts(config, checkpoint_dir):
    """The rollout side's tokenizer: ``vl_prompts`` with ``--multimodal-keys``, else
    ``tokenizer.rollout_tokenizer``."""
    if config.multimodal.image_key is not None:
        return vl_prompts(config, checkpoint_dir)
    return rollout_tokenizer(config, checkpoint_dir)
