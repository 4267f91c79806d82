"""SFT on conversations with images (``--loss-type sft_loss`` with ``--multimodal-keys``).

``sft_example(tokenizer, record)`` is the SFT source's and the preflight's ``sft.example_of``: a
record with images goes through ``image_example(prompts, record, messages, where)``, which is ``sft.chat_example`` with the processor in
the tokenizer's place (``VLPrompts``, the same expansion an RL prompt gets):

- the record's images are opened (``images.open_images``) and given places as for an RL prompt:
  a prompt string's ``<image>`` markers (none: every image first in the user turn), a chat's image
  content parts; the places must number the images (else the record is named);
- the whole conversation's text (the processor's chat template, image placeholders) is encoded
  ONCE by the processor: the ids with each placeholder expanded to its image's
  ``prod(grid) / merge**2`` tokens, ``pixel_values`` and ``image_grid_thw``;
- the assistant spans are ``sft.chat_example``'s: each prefix render is the template's text of
  the turns before (after) an assistant turn, its placeholders expanded to the same per-image
  token counts and tokenised; each must be a token prefix of the whole (else refused, naming the
  record), so the mask is 1 on the assistant tokens and their end-of-turn token only.

Image tokens are never trained: the images must sit before the first assistant turn (in the
loss core's "prompt", where ``backends/fsdp/vision.py`` places image embeddings); an image in a
later turn is refused naming the record (split the conversation there).
"""

from __future__ import annotations

from typing import List

from rl_plugin.models.vl_processor import encode
from rl_plugin.rollout.data.dataset import Messages, PromptRecord
from rl_plugin.rollout.data.images import open_images
from rl_plugin.rollout.data.sft import SftExample, chat_example, conversation, example_of
from rl_plugin.rollout.data.vl_prompt import MARKER


def sft_example(tokenizer, record: PromptRecord) -> SftExample:
    """``sft.example_of`` for any run: a record with images (``--multimodal-keys``) through the
    processor (``image_example``), any other as ``example_of`` templates it."""
    if record.images is None:
        return example_of(tokenizer, record)
    where = record.where or f"record {record.index}"
    if not tokenizer.apply_chat_template:
        return example_of(tokenizer, record)  # refused there, naming the flag
    return image_example(tokenizer, record, conversation(record), where)


def image_example(prompts, record: PromptRecord, messages: Messages, where: str) -> SftExample:
    """``record``'s conversation ``messages`` with its images, templated and masked (module docstring)."""
    proc = prompts.processor
    images = open_images(where, "images", record.images)
    if isinstance(record.prompt, str) and MARKER not in record.prompt:  # no marker: the images first
        messages = [{**messages[0], "content": MARKER * len(images) + messages[0]["content"]}, *messages[1:]]

    def text(turns: Messages, gen: bool) -> str:
        parts = prompts.image_messages(turns)  # <image> markers -> image parts
        return proc.apply_chat_template(
            parts, add_generation_prompt=gen, tokenize=False, **prompts.chat_template_kwargs
        )

    whole = text(prompts.messages(messages), False)
    places = whole.count(prompts.placeholder)
    if places != len(images):
        raise ValueError(
            f"{where}: the conversation marks {places} image places (<image> markers or image content parts) for "
            f"{len(images)} images. Fix: mark each image once, in order (or none in a prompt string: images first)"
        )
    ids, pixels, grid = encode(proc, whole, images)
    counts = (grid.prod(-1) // prompts.merge**2).tolist() if grid is not None else []

    def render(turns: Messages, gen: bool) -> List[int]:
        pieces = text(turns, gen).split(proc.image_token)
        expanded = pieces[0] + "".join(proc.image_token * n + p for n, p in zip(counts, pieces[1:]))
        return proc.tokenizer(expanded, add_special_tokens=False)["input_ids"]

    example = chat_example(prompts, messages, where, render=render)
    if example.ids != ids:
        raise ValueError(f"{where}: the processor's ids differ from the chat template's render of the conversation")
    late = sum(int(t == proc.image_token_id) for t in ids[example.prompt_length :])
    if late:
        raise ValueError(
            f"{where}: {late} image tokens come after the first assistant turn; SFT with images trains conversations "
            "whose images all come before the first answer (image tokens are never trained). Fix: move the images "
            "into the turns before the first assistant turn, or split the conversation there"
        )
    example.pixel_values, example.image_grid_thw = pixels, grid
    return example
