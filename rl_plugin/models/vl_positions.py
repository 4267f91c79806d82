"""M-RoPE (3-D) positions of packed vision-language samples, shared by both backends.

``packed_positions(rope, batch)`` returns ``positions [3, sum T_i]`` and ``image_mask [sum T_i]``
for a ``StepBatch``'s packed samples (images in ``loss.batch``'s layout). Each sample (prompt and
response) gets the model's own 3-D rope index (``rope.get_rope_index``: text positions count 1 per
token, an image's tokens its (t, h, w) grid from the position after the text before it, the text
after an image resumes at ``max + 1``) over its image tokens: the prompt's ``<|image_pad|>`` ids
and the response's with loss mask 0 (an image a hook appended in a tool turn, ``rollout.vl_turns``).
That is what the engine used: ``generate`` decodes from the prefill's largest position + 1, one per
token (its ``rope_deltas``), which is the rope index of text after the last image, and each later
turn re-prefills the whole history with its image tokens marked. An image token the engine sampled
in a response (loss mask 1) is an ordinary text position, as it was for the engine. ``image_mask``
marks the same image tokens (where the image embeddings go). One padded ``get_rope_index`` call per
micro-batch, rows masked by their lengths.

``rope``: the Hugging Face model (FSDP) or ``RopeIndex(hf_config)`` (Megatron: transformers' own
``get_rope_index`` on the checkpoint's config, no model built), so both backends and the hf engine
place every token at the same position.
"""

from __future__ import annotations

from typing import Dict

import torch


class RopeIndex:
    """transformers' ``Qwen2_5_VLModel.get_rope_index`` over a config alone (it reads only
    ``self.config`` and ``self.get_vision_position_ids``)."""

    def __init__(self, config):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = config
        self._model_class = Qwen2_5_VLModel

    def get_rope_index(self, *args, **kwargs):
        return self._model_class.get_rope_index(self, *args, **kwargs)

    def get_vision_position_ids(self, *args, **kwargs):
        return self._model_class.get_vision_position_ids(self, *args, **kwargs)


def image_places(ids: torch.Tensor, image_token_id: int, trained_response: torch.Tensor) -> torch.Tensor:
    """Which ids are image tokens, the one rule the engines and both trainers share: an image pad
    (``image_token_id``) except where the model sampled it (``trained_response``: a response token
    with a nonzero loss mask). Any shape, elementwise; bool."""
    return (ids == int(image_token_id)) & ~trained_response


def packed_positions(rope, batch) -> Dict[str, torch.Tensor]:
    """``positions`` ``[3, sum T_i]`` and ``image_mask`` ``[sum T_i]`` (module docstring)."""
    tl, rl = batch.total_lengths.long(), batch.response_lengths.long()
    num, longest = tl.numel(), int(tl.max())
    cols = torch.arange(longest)
    valid = cols[None, :] < tl[:, None]  # [S, L]
    ids = torch.zeros(num, longest, dtype=torch.long)
    ids[valid] = batch.tokens.long()
    in_prompt = cols[None, :] < (tl - rl)[:, None]
    trained = torch.zeros(num, longest, dtype=torch.bool)  # a response's image pad the model sampled is text
    trained[valid & ~in_prompt] = batch.loss_mask != 0
    image = image_places(ids, rope.config.image_token_id, trained)
    grid = batch.image_grid_thw if batch.image_grid_thw is not None and batch.image_grid_thw.numel() else None
    if grid is None:
        pos = cols.expand(3, num, longest).clone()
    else:
        pos, _ = rope.get_rope_index(ids, image.int(), image_grid_thw=grid, attention_mask=valid.long())
    return {"positions": pos[:, valid], "image_mask": image[valid]}
