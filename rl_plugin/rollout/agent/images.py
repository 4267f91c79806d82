"""Images on the agent endpoint (``--multimodal-keys``): OpenAI ``image_url`` content parts.

A chat message's content may hold ``{"type": "image_url", "image_url": {"url": URL}}`` parts (or
``"image_url": URL``), in the first turn or any later one (a tool that returns an image); URL is a
``data:image/...;base64,`` URI or a file path (``file://`` accepted). The chat template renders each
as the processor's placeholder (``<|vision_start|><|image_pad|><|vision_end|>``) and the processor
expands it into the image's tokens (``ChatImages.prompt``):

- a turn that starts a sample: the whole rendered text with every image of the chat;
- an appended turn (``sessions``: the text starts with the previous prompt + completion, compared
  with each image block collapsed back to its placeholder, ``collapse``) whose earlier images are
  the previous turn's (same URLs): the previous ids as they were, then the rest of the text with
  the new images only. Otherwise the turn starts a new sample.

The engine gets an ``ImagePrompt`` (every image so far, ``mm_token_type_ids`` 1 at the image
tokens: the previous turn's, none of its output, the new ones), and the turn's record keeps the
images (``records.TurnRecord.images``), so the session's sample carries them
(``multimodal_inputs`` / ``multimodal_train_inputs``) with loss mask 0 on their tokens. A chat whose
image places differ from its ``image_url`` parts, an image that does not open, or image-pad ids
without an image (a literal ``<|image_pad|>`` in a message) is a 400 naming ``messages``.

``agent_prompt``: a dataset record with images reaches the agent as chat messages whose image
parts are ``image_url`` data URIs of those images, so the agent sends them back like any other.
"""

from __future__ import annotations

import base64
import io
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from rl_plugin.rollout.agent.chat import bad


def _urls(messages: List[Dict[str, Any]]) -> List[str]:
    """The ``image_url`` URLs of ``messages``, in order (400 for a part without one)."""
    out = []
    for k, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("image_url", "image"):
                continue
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise bad("messages", f"message {k}: an image part needs image_url.url (a data: URI or a file path)")
            out.append(url[len("file://") :] if url.startswith("file://") else url)
    return out


def data_uri(image) -> str:
    """A PIL image as a ``data:image/png;base64,`` URI."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def agent_prompt(prompts, prompt, images: List[Any]) -> List[Dict[str, Any]]:
    """The chat an agent gets for a record with ``images`` (module docstring)."""
    from rl_plugin.rollout.data.vl_prompt import MARKER

    if isinstance(prompt, str) and MARKER not in prompt:
        prompt = MARKER * len(images) + prompt  # no marker: the images first (``VLPrompts.image_prompt``)
    left = iter(images)
    out = []
    for m in prompts.image_messages(prompt):
        parts = [
            {"type": "image_url", "image_url": {"url": data_uri(next(left))}} if p.get("type") == "image" else p
            for p in m["content"]
        ]
        out.append({**m, "content": parts})
    return out


class ChatImages:
    """The image side of the endpoint for a run's ``VLPrompts`` (module docstring)."""

    def __init__(self, prompts):
        self.processor = prompts.processor
        self.image_id = int(self.processor.image_token_id)
        self.merge = int(self.processor.image_processor.merge_size)
        self.placeholder = prompts.placeholder
        start, pad, end = (re.escape(t) for t in ("<|vision_start|>", self.processor.image_token, "<|vision_end|>"))
        self._block = re.compile(f"{start}(?:{pad})+{end}")

    def collapse(self, text: str) -> str:
        """``text`` with each expanded image block back to its placeholder."""
        return self._block.sub(self.placeholder, text)

    def _open(self, session, urls: List[str]) -> List[Any]:
        from rl_plugin.rollout.data.images import open_image

        cache = session.image_cache
        for url in urls:
            if url not in cache:
                try:
                    cache[url] = open_image(url)
                except ValueError as exc:
                    raise bad("messages", f"image_url {url[:60]!r}: {exc}") from None
        return [cache[u] for u in urls]

    def prompt(self, session, text: str, messages) -> Tuple[List[int], bool, Dict[str, Any]]:
        """``(ids, appended, images)`` of a chat turn rendered as ``text`` (module docstring): the
        ids an ``ImagePrompt``, ``images`` what the turn's record keeps."""
        from rl_plugin.models.vl_processor import encode
        from rl_plugin.rollout.data.vl_prompt import ImagePrompt

        urls = _urls(messages)
        pictures = self._open(session, urls)
        if text.count(self.placeholder) != len(urls):
            raise bad(
                "messages",
                f"the chat template renders {text.count(self.placeholder)} image places for {len(urls)} image_url parts",
            )
        prev = session.records[-1].images if session.records else None
        made: Dict[str, Any] = {}

        def whole() -> List[int]:
            ids, pixels, grid = encode(self.processor, text, pictures)
            made.update(pixel_values=pixels, image_grid_thw=grid, mask=[int(i == self.image_id) for i in ids])
            return ids

        def rest(piece: str) -> List[int]:
            k = len(prev["urls"])
            ids, pixels, grid = encode(self.processor, piece, pictures[k:])
            last = session.records[-1]
            made.update(
                pixel_values=_cat(prev["pixel_values"], pixels),
                image_grid_thw=_cat(prev["image_grid_thw"], grid),
                mask=prev["mask"] + [0] * len(last.output_ids) + [int(i == self.image_id) for i in ids],
            )
            return ids

        if prev is not None and prev["urls"] == urls[: len(prev["urls"])]:
            ids, appended = session.prompt_ids(text, whole, rest)
        else:
            ids, appended = whole(), False
        if not made:  # appended with nothing new after the previous prompt + completion
            last = session.records[-1]
            made.update(
                {k: prev[k] for k in ("pixel_values", "image_grid_thw")}, mask=prev["mask"] + [0] * len(last.output_ids)
            )
        grid = made["image_grid_thw"]
        want = 0 if grid is None else int(grid.prod(dim=1).sum()) // (self.merge * self.merge)
        if sum(made["mask"]) != want:
            raise bad("messages", f"{sum(made['mask'])} image-pad tokens for {len(urls)} images of {want} tokens")
        images = {"image": pictures, "urls": urls, **made}
        request = ImagePrompt(ids, made["pixel_values"], grid, pictures, self.image_id, mm_token_type_ids=made["mask"])
        return request, appended, images


def _cat(before: Optional[torch.Tensor], new: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if before is None or new is None:
        return new if before is None else before
    return torch.cat([before, new])
