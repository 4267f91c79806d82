"""Images in later turns: a custom generate hook's (or rollout function's) sample with images.

In a run with ``--multimodal-keys`` a hook's sample arrives with its prompt's images:
``tokens`` are the processor's expanded prompt ids (one ``<|image_pad|>`` per image token),
``multimodal_inputs = {"image": [PIL]}`` and ``multimodal_train_inputs = {"pixel_values",
"image_grid_thw"}``. A hook that keeps the sample current turn by turn (``tokens``,
``response_length``, ``loss_mask``, ``rollout_log_probs`` appended as it goes, slime's style) adds
an image in a later turn (a tool that returns one) with

    ids = append_image(sample, image)      # PIL image; inside a rollout, like generate_tokens

which appends the processor's expansion of one image placeholder
(``<|vision_start|>``, the image's ``prod(grid) / merge**2`` ``<|image_pad|>`` ids,
``<|vision_end|>``; the hook adds the text around it with its tokenizer) to ``tokens`` with loss
mask 0 and log-prob 0.0, and the image's ``pixel_values`` / ``image_grid_thw`` after the earlier
ones (new objects: the group's samples share the prompt's). The engine then sees every image so
far when the hook passes the sample:

    out = await generate_tokens(args, sample.tokens, sampling_params, sample=sample)

Which ids are image tokens (``image_token_mask``): an ``<|image_pad|>`` id of the prompt, or of
the response where the loss mask is 0 (what ``append_image`` put there). One the model sampled
(loss mask 1) is an ordinary token, for the engine (``hf_engine``'s placeholder mask) and the
trainer (``backends/fsdp/vision.py``) alike. The image tokens of a sample must match its images'
features (``check_image_tokens``, after the hook returns; a cut sample keeps whole images only,
``drop_cut_images``).
"""

from __future__ import annotations

import contextvars
from typing import Any, List, Optional, Sequence

import torch

from rl_plugin.models.vl_positions import image_places
from rl_plugin.rollout.sample import Sample

# the running rollout's prompt tokenizer (``generate.EngineRouter.bind`` sets it beside the router)
RUN_PROMPTS: contextvars.ContextVar = contextvars.ContextVar("rl_plugin_run_prompts", default=None)


def image_token_mask(
    tokens: Sequence[int], response_length: int, loss_mask: Optional[Sequence[int]], image_token_id: int
) -> List[int]:
    """1 at each image token of ``tokens`` (module docstring; ``models.vl_positions.image_places``,
    the trainers' rule), 0 elsewhere."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    trained = torch.zeros(len(ids), dtype=torch.bool)
    if response_length:  # no loss mask: every response token is the model's
        mask = loss_mask if loss_mask is not None else [1] * response_length
        trained[len(ids) - response_length :] = torch.as_tensor(list(mask), dtype=torch.long) != 0
    return image_places(ids, image_token_id, trained).long().tolist()


def _prompts():
    """The running rollout's prompt tokenizer with its processor (``VLPrompts``; set by
    ``generate.EngineRouter.bind``)."""
    prompts = RUN_PROMPTS.get()
    if prompts is None:
        raise RuntimeError(
            "append_image runs inside a rollout: call it from a --custom-generate-function-path hook or a "
            "--rollout-function-path function"
        )
    if getattr(prompts, "processor", None) is None:
        raise RuntimeError(
            "append_image: this run reads no images (a text model's tokenizer); pass --multimodal-keys with a "
            "vision-language --hf-checkpoint"
        )
    return prompts


def append_image(sample: Sample, image: Any) -> List[int]:
    """Append ``image`` (a PIL image) to ``sample`` as tool tokens (module docstring); returns the
    ids appended. The run's processor (its ``--min-pixels`` / ``--max-pixels``) encodes it."""
    from rl_plugin.models.vl_processor import encode

    prompts = _prompts()
    ids, pixels, grid = encode(prompts.processor, prompts.placeholder, [image])
    sample.tokens = list(sample.tokens) + ids
    had = int(sample.response_length or 0)
    sample.response_length = had + len(ids)
    sample.loss_mask = (list(sample.loss_mask) if sample.loss_mask is not None else [1] * had) + [0] * len(ids)
    sample.rollout_log_probs = list(sample.rollout_log_probs or []) + [0.0] * len(ids)
    shown = dict(sample.multimodal_inputs or {})
    shown["image"] = [*shown.get("image", []), image]
    sample.multimodal_inputs = shown
    train = sample.multimodal_train_inputs
    if train is not None:
        pixels = torch.cat([train["pixel_values"], pixels])
        grid = torch.cat([train["image_grid_thw"], grid])
    sample.multimodal_train_inputs = {"pixel_values": pixels, "image_grid_thw": grid}
    return ids


def image_request(sample: Sample, ids: List[int], image_token_id: int):
    """``ids`` (a hook's ``generate_tokens`` input, starting with ``sample.tokens``) as the engine's
    ``ImagePrompt``: the sample's images, its image tokens marked (module docstring)."""
    from rl_plugin.rollout.data.vl_prompt import ImagePrompt

    tokens = list(sample.tokens)
    if ids[: len(tokens)] != tokens:
        raise ValueError(
            "generate_tokens: with sample=, input_ids must start with sample.tokens (the conversation so far, its "
            "image tokens where append_image put them); keep the sample current turn by turn and pass sample.tokens"
        )
    mask = image_token_mask(tokens, int(sample.response_length or 0), sample.loss_mask, image_token_id)
    mask += [0] * (len(ids) - len(tokens))
    train = sample.multimodal_train_inputs or {}
    shown = (sample.multimodal_inputs or {}).get("image", [])
    return ImagePrompt(
        ids, train.get("pixel_values"), train.get("image_grid_thw"), shown, image_token_id, mm_token_type_ids=mask
    )


def image_token_count(grid: Optional[torch.Tensor], merge: int) -> int:
    """The image tokens of images of ``grid`` ``[images, 3]`` (``prod / merge**2`` each)."""
    return 0 if grid is None else int(grid.prod(dim=1).sum()) // (merge * merge)


def check_image_tokens(samples: Sequence[Sample], image_token_id: int, merge: int, hook: str) -> None:
    """Every sample's image tokens (``image_token_mask``) match its images' features, else a
    ``ValueError`` naming ``hook`` and the sample (a hook that appended ``<|image_pad|>`` ids itself,
    or dropped ``multimodal_train_inputs``)."""
    from rl_plugin.rollout.sample_check import describe_sample

    for i, s in enumerate(samples):
        grid = (s.multimodal_train_inputs or {}).get("image_grid_thw")
        want = image_token_count(grid, merge)
        got = sum(image_token_mask(s.tokens, s.response_length, s.loss_mask, image_token_id))
        if got != want:
            images = 0 if grid is None else int(grid.shape[0])
            raise ValueError(
                f"{hook}: {describe_sample(s, i)}: {got} image tokens (<|image_pad|> in the prompt or with loss mask 0) "
                f"for {images} images of {want} tokens; add images with rl_plugin.rollout.append_image(sample, image), "
                "which appends the tokens and the pixels together"
            )


def drop_cut_images(sample: Sample, image_token_id: int, merge: int) -> None:
    """After a cut (``sample_check.hold_to_limits``): the images whose tokens were cut (wholly or
    partly) leave the sample, and so do the kept ids of a partly cut image, so tokens and pixels
    still match."""
    train = sample.multimodal_train_inputs
    if not train:
        return
    grid, pixels = train["image_grid_thw"], train["pixel_values"]
    per_image = (grid.prod(dim=1) // (merge * merge)).tolist()
    mask = image_token_mask(sample.tokens, sample.response_length, sample.loss_mask, image_token_id)
    kept_tokens = sum(mask)
    whole, seen = 0, 0
    for n in per_image:
        if seen + n > kept_tokens:
            break
        whole, seen = whole + 1, seen + n
    if whole == len(per_image):
        return
    if seen < kept_tokens:  # a partly cut image: cut the sample before its first token
        at = [k for k, m in enumerate(mask) if m][seen]
        keep = at - (len(sample.tokens) - sample.response_length)
        if keep < 1:
            raise ValueError(
                "a sample cut to the limits keeps no response token before an image it cannot hold whole; "
                "raise --rollout-max-response-len or end the conversation sooner"
            )
        sample.tokens = list(sample.tokens[: len(sample.tokens) - sample.response_length + keep])
        sample.response_length = keep
        sample.loss_mask = None if sample.loss_mask is None else list(sample.loss_mask[:keep])
        sample.rollout_log_probs = list(sample.rollout_log_probs[:keep])
    patches = int(grid[:whole].prod(dim=1).sum())
    sample.multimodal_train_inputs = {"pixel_values": pixels[:patches], "image_grid_thw": grid[:whole]}
    if sample.multimodal_inputs and "image" in sample.multimodal_inputs:
        sample.multimodal_inputs = {**sample.multimodal_inputs, "image": sample.multimodal_inputs["image"][:whole]}
