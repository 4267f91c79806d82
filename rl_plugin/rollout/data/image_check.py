"""Start-up check of a ``--multimodal-keys`` run: the checkpoint sees images, every image opens,
every sample's image tokens fit the context.

``check_vl_checkpoint(hf_checkpoint)``: a text-only checkpoint given ``--multimodal-keys`` is
refused naming the flag (its model would never see the images), and so is a vision-language family
other than Qwen2-VL / Qwen2.5-VL (``VL_MODEL_TYPES``). ``check_image_prompt_file``: each
record of a prompt file is read (a bad record names its ``file:line``), each of its images opened
(a missing or undecodable one names ``file:line`` and the image's index), and the prompt encoded by
the processor (``vl_prompt.VLPrompts.image_prompt``): its ids count the image tokens at the run's
``--min-pixels`` / ``--max-pixels``. A prompt whose ids plus ``--rollout-max-response-len`` pass the
context (``--rollout-max-context-len``, else the model's ``max_position_embeddings``) is refused
with its image-token count and the ``--max-pixels`` that would fit.
"""

from __future__ import annotations

from typing import Optional

from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.models.vl_processor import VL_MODEL_TYPES, checkpoint_model_type, has_vision_config, is_vl_checkpoint
from rl_plugin.rollout.data.dataset import read_prompts
from rl_plugin.rollout.data.images import open_images
from rl_plugin.rollout.data.prompt_check import check_labels
from rl_plugin.rollout.data.tokenizer import PromptFormatError

TOKEN_PIXELS = 28 * 28  # Qwen2(.5)-VL: one image token per 28 x 28 pixels (patch 14, 2 x 2 merge)


def check_vl_checkpoint(hf_checkpoint: Optional[str]) -> None:
    """``--multimodal-keys`` needs a vision-language ``--hf-checkpoint`` (module docstring)."""
    if hf_checkpoint is None:
        fail(
            "--multimodal-keys without --hf-checkpoint",
            "the embedded default model is text-only",
            "pass a vision-language checkpoint, e.g. --hf-checkpoint DIR after `python -m rl_plugin.models.tiny_vl DIR`",
        )
    if not is_vl_checkpoint(hf_checkpoint) and has_vision_config(hf_checkpoint):
        fail(
            f"--multimodal-keys with --hf-checkpoint {hf_checkpoint}",
            f"its vision-language family (model_type {checkpoint_model_type(hf_checkpoint)!r}) is not one rl_plugin "
            f"trains ({', '.join(VL_MODEL_TYPES)}): its image placeholders, positions and vision tower would be guessed",
            "convert the model to a Qwen2-VL / Qwen2.5-VL checkpoint, or drop --multimodal-keys",
        )
    if not is_vl_checkpoint(hf_checkpoint):
        fail(
            f"--multimodal-keys with --hf-checkpoint {hf_checkpoint}",
            f"that checkpoint is a text-only model (model_type {checkpoint_model_type(hf_checkpoint)!r}, no vision tower): "
            "it would never see the images",
            "pass a Qwen2-VL / Qwen2.5-VL checkpoint, or drop --multimodal-keys",
        )


def check_image_prompt_file(
    flag: str,
    path,
    prompts,
    *,
    input_key: str,
    label_key: Optional[str],
    metadata_key: Optional[str],
    image_key: str,
    max_response_len: int,
    context_len: Optional[int],
    rm_type: Optional[str] = None,
) -> int:
    """Raise ``RLArgumentError`` naming the first bad record (module docstring); ``prompts`` is the
    run's ``VLPrompts``. Returns the longest prompt in tokens (image tokens included)."""
    try:
        records = read_prompts(path, input_key, label_key, metadata_key, image_key=image_key)
    except (ValueError, FileNotFoundError) as exc:
        raise RLArgumentError(f"{flag}: {exc}. Fix: correct that line of the file") from None
    check_labels(flag, path, records, rm_type=rm_type, label_key=label_key)
    image_id = prompts.processor.image_token_id
    longest = 0
    for rec in records:
        try:
            images = open_images(rec.where, image_key, rec.images)
        except ValueError as exc:
            fail(f"{flag} {rec.where}", str(exc).split(": ", 1)[1], "fix or drop that image (or the record)")
        try:
            ids = prompts.image_prompt(rec.prompt, images)
        except PromptFormatError as exc:
            fail(f"{flag} {rec.where}", exc.rule, exc.fix)
        longest = max(longest, len(ids))
        if context_len is not None and len(ids) + max_response_len > context_len:
            image_tokens = ids.count(image_id)
            room = context_len - max_response_len - (len(ids) - image_tokens)
            fix = (
                f"lower --max-pixels to {max(room, 1) // max(len(images), 1) * TOKEN_PIXELS} ({room} image tokens "
                f"for its {len(images)} images)"
                if room >= len(images)
                else "shorten the prompt's text"
            )
            fail(
                f"{flag} {rec.where}",
                f"the prompt is {len(ids)} tokens ({image_tokens} of them image tokens), and with "
                f"--rollout-max-response-len {max_response_len} a sample can reach {len(ids) + max_response_len} "
                f"tokens, more than the context of {context_len} (--rollout-max-context-len, else the model's "
                "max_position_embeddings)",
                f"{fix}, or lower --rollout-max-response-len",
            )
    return longest
