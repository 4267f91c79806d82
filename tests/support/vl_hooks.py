"""Custom generate hooks with images in a later turn, for the tiny Qwen2.5-VL model (user code, loaded by
--custom-generate-function-path / --rollout-function-path; ids: bytes 0..255, then <|endoftext|>,
<|im_start|>, <|im_end|>, ..., ``rl_plugin.models.tiny_vl``).

``image_tool_turn``: turn 1 samples up to ``TURN_TOKENS`` ids; a "tool" answers with an image as a
user turn (``<|im_end|>\\n<|im_start|>user\\n`` + ``append_image`` + ``colour?<|im_end|>\\n<|im_start|>assistant\\n``,
loss mask 0), the image a 56 x 84 block of ``metadata["tool_colour"]`` (grey without), and turn 2
samples up to ``TURN_TOKENS`` ids with every image so far (``generate_tokens(..., sample=sample)``).
The sample is kept current turn by turn. ``metadata["sampled_pad"]``: an ``<|image_pad|>`` id is
appended after turn 1 as if the model had sampled it (loss mask 1): text, not an image place.
"""

from __future__ import annotations

import re

from PIL import Image

from rl_plugin.rollout import Sample, append_image, generate_tokens

TURN_TOKENS = 3
GREY = (128, 128, 128)


def _ids(text: str):
    """The tiny VL tokenizer's ids of ``text`` (byte b is id b; the two ChatML markers are specials)."""
    from rl_plugin.models.tiny_vl import BOS_ID, EOS_ID

    special = {"<|im_start|>": BOS_ID, "<|im_end|>": EOS_ID}
    out = []
    for piece in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
        out += [special[piece]] if piece in special else list(piece.encode())
    return out


def _append(sample: Sample, ids, mask: int, log_probs=None) -> None:
    sample.tokens = sample.tokens + list(ids)
    sample.response_length += len(ids)
    sample.loss_mask = (sample.loss_mask or []) + [mask] * len(ids)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + list(log_probs or [0.0] * len(ids))


async def image_tool_turn(args, sample: Sample, sampling_params) -> Sample:
    from rl_plugin.models.tiny_vl import IMAGE_ID

    params = dict(sampling_params, max_new_tokens=TURN_TOKENS)
    first = await generate_tokens(args, sample.tokens, params, sample=sample)
    _append(sample, first["output_ids"], 1, first["output_log_probs"])
    if sample.metadata.get("sampled_pad"):
        _append(sample, [IMAGE_ID], 1)
    _append(sample, _ids("<|im_end|>\n<|im_start|>user\n"), 0)
    append_image(sample, Image.new("RGB", (56, 84), tuple(sample.metadata.get("tool_colour", GREY))))
    _append(sample, _ids("colour?<|im_end|>\n<|im_start|>assistant\n"), 0)
    second = await generate_tokens(args, sample.tokens, params, sample=sample)
    _append(sample, second["output_ids"], 1, second["output_log_probs"])
    sample.status = Sample.Status.COMPLETED if second["finish_reason"] == "stop" else Sample.Status.TRUNCATED
    sample.metadata.update(turns=2, tool_calls=1)
    return sample


async def image_rollout_fn(args, rollout_id, data_source, evaluation=False):
    """slime's whole-rollout form: every sample of the rollout through ``image_tool_turn``."""
    import asyncio

    groups = data_source.get_samples(args.rollout_batch_size)
    await asyncio.gather(*(image_tool_turn(args, s, {}) for g in groups for s in g))
    return groups


async def forgets_the_sample(args, sample: Sample, sampling_params) -> Sample:
    """Passes the prompt's image tokens without its images (refused: the model would not see them)."""
    await generate_tokens(args, sample.tokens, sampling_params)
    return sample


async def pads_by_hand(args, sample: Sample, sampling_params) -> Sample:
    """Appends <|image_pad|> ids itself (loss mask 0) with no pixels: refused after the hook."""
    from rl_plugin.models.tiny_vl import IMAGE_ID

    out = await generate_tokens(args, sample.tokens, sampling_params, sample=sample)
    _append(sample, out["output_ids"], 1, out["output_log_probs"])
    _append(sample, [IMAGE_ID] * 4, 0)
    return sample


async def colour_tool_turn(args, sample: Sample, sampling_params) -> Sample:
    """The colour task with the colour shown by a tool (``tests/fast/e2e/test_vl_tool_turn_loop.py``):
    the prompt's image is grey; turn 1 is one token, then the tool shows the label's colour
    (``vl_task.COLOURS``, a 56 x 56 square), and turn 2's one token is the answer (``tool_colour_reward``)."""
    from rl_plugin.rollout.data.vl_task import COLOURS

    params = dict(sampling_params, max_new_tokens=1)
    first = await generate_tokens(args, sample.tokens, params, sample=sample)
    _append(sample, first["output_ids"], 1, first["output_log_probs"])
    _append(sample, _ids("<|im_end|>\n<|im_start|>user\n"), 0)
    k = int(str(sample.label).split("/")[0])
    append_image(sample, Image.new("RGB", (56, 56), COLOURS[k][1]))
    _append(sample, _ids("<|im_end|>\n<|im_start|>assistant\n"), 0)
    second = await generate_tokens(args, sample.tokens, params, sample=sample)
    _append(sample, second["output_ids"], 1, second["output_log_probs"])
    sample.status = Sample.Status.COMPLETED
    sample.metadata.update(turns=2, tool_calls=1)
    return sample


async def tool_colour_reward(args, sample: Sample) -> float:
    """1.0 when the last token (turn 2's answer) names the label's colour (``vl_task.answer_class``)."""
    from rl_plugin.rollout.data.vl_task import answer_class

    k, num_colours = (int(x) for x in str(sample.label).split("/"))
    return float(answer_class(sample.tokens[-1], num_colours) == k)
