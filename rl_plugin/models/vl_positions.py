"""M-RoPE (3-D) positions of packed vision-language samples, shared by both backends.

``packed_positions(rope, batch)`` returns ``positions [3, sum T_i]`` and ``image_mask [sum T_i]``
for a ``StepBatch``'s packed samples (images in ``loss.batch``'s layout). Each sample's prompt gets
the model's own 3-D rope index (``rope.get_rope_index``: text positions count 1 per token, an
image's tokens its (t, h, w) grid from the position after the text before it, the text after an
image resumes at ``max + 1``), and its response continues linearly from the prompt's largest
position + 1 on all three axes: what ``generate`` does while decoding (its ``rope_deltas``), so an
image token the engine happened to sample in a response is an ordinary text position.
``image_mask`` marks the prompt's image tokens only. One padded ``get_rope_index`` call per
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


def packed_positions(rope, batch) -> Dict[str, torch.Tensor]:
    """``positions`` ``[3, sum T_i]`` and ``image_mask`` ``[sum T_i]`` (module docstring)."""
    tl, rl = batch.total_lengths.long(), batch.response_lengths.long()
    num, longest = tl.numel(), int(tl.max())
    cols = torch.arange(longest)
    valid = cols[None, :] < tl[:, None]  # [S, L]
    ids = torch.zeros(num, longest, dtype=torch.long)
    ids[valid] = batch.tokens.long()
    in_prompt = cols[None, :] < (tl - rl)[:, None]
    image = (ids == rope.config.image_token_id) & in_prompt
    grid = batch.image_grid_thw if batch.image_grid_thw is not None and batch.image_grid_thw.numel() else None
    if grid is None:
        pos = cols.expand(3, num, longest).clone()
    else:
        prompt_ids = torch.where(in_prompt, ids, 0)
        pos, _ = rope.get_rope_index(prompt_ids, image.int(), image_grid_thw=grid, attention_mask=in_prompt.long())
    # the response continues from the prompt's largest position, 1 per token on every axis
    last = torch.where(in_prompt[None], pos, -1).amax(dim=2, keepdim=True)  # [3, S, 1]
    after = last + 1 + (cols - (tl - rl)[:, None])[None]
    pos = torch.where(in_prompt[None], pos, after)
    return {"positions": pos[:, valid], "image_mask": image[valid]}
