"""MultimodalConfig: where a prompt record keeps its images, and how many pixels an image becomes.

``--multimodal-keys`` is slime's: a JSON object from media type to record key, e.g.
``'{"image": "images"}'``: each record's ``images`` holds a list of images (a file path, relative
to the data file's folder or absolute; a ``data:image/...;base64,`` URI; bytes in Parquet). A text
prompt marks each image's place with ``<image>`` (verl's convention; without a marker the images
come first), a chat message's content may hold image parts (``{"type": "image"}``; OpenAI's
``image_url`` parts too). ``--min-pixels`` / ``--max-pixels`` are the processor's names: an image is
resized (aspect kept) to within [min, max] pixels, so it becomes ``pixels / (patch * merge)**2``
image tokens (Qwen2.5-VL: 28 x 28 pixels per token); unset, the checkpoint's processor decides.
The start-up check (``rl_plugin.arguments.file_contents``) opens every image and bounds each
sample's image tokens against ``--rollout-max-context-len``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Dict, Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag

MEDIA_TYPES = ("image",)  # what the data layer reads (video: not yet)


def parse_multimodal_keys(value: str) -> Dict[str, str]:
    """argparse ``type`` of ``--multimodal-keys``: a JSON object of media type -> record key."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f'{value!r} is not valid JSON ({exc.msg}). Fix: pass an object, e.g. \'{{"image": "images"}}\''
        ) from None
    if not isinstance(out, dict) or not out or not all(isinstance(v, str) and v for v in out.values()):
        raise argparse.ArgumentTypeError(
            f'{value!r} must be a non-empty JSON object of media type -> record key, e.g. \'{{"image": "images"}}\''
        )
    return out


@dataclass(frozen=True)
class MultimodalConfig(Declared):
    multimodal_keys: Optional[Dict[str, str]] = flag(
        "--multimodal-keys",
        type=parse_multimodal_keys,
        default=None,
        group="rollout",
        metavar="JSON",
        help='Vision-language data (slime\'s flag): a JSON object from media type to the record key holding that media, e.g. \'{"image": "images"}\'. Images are file paths (relative to the data file), data: URIs or bytes (Parquet); a text prompt marks each image with <image> (none: images first), chat messages use {"type": "image"} content parts. Needs a vision-language --hf-checkpoint (Qwen2-VL / Qwen2.5-VL).',
    )
    min_pixels: Optional[int] = flag(
        "--min-pixels",
        type=int,
        default=None,
        group="rollout",
        help="Smallest size, in pixels, an image is resized to (aspect kept; the processor's min_pixels). Unset: the checkpoint's processor's.",
    )
    max_pixels: Optional[int] = flag(
        "--max-pixels",
        type=int,
        default=None,
        group="rollout",
        help="Largest size, in pixels, an image is resized to (the processor's max_pixels): bounds an image's tokens (Qwen2.5-VL: max_pixels / 784). Lower it when images crowd out the response in --rollout-max-context-len. Unset: the checkpoint's processor's.",
    )

    @property
    def image_key(self) -> Optional[str]:
        """The record key of the images (None: a text-only run)."""
        return (self.multimodal_keys or {}).get("image")

    def check(self, run) -> None:
        keys = self.multimodal_keys or {}
        unknown = sorted(set(keys) - set(MEDIA_TYPES))
        if unknown:
            fail(
                f"--multimodal-keys {json.dumps(keys)}",
                f"media type {', '.join(unknown)} is not read (rl_plugin reads {', '.join(MEDIA_TYPES)})",
                'map only images, e.g. \'{"image": "images"}\'',
            )
        for name, value in (("--min-pixels", self.min_pixels), ("--max-pixels", self.max_pixels)):
            if value is None:
                continue
            if value < 1:
                fail(name, f"must be >= 1 (got {value})", f"use e.g. {name} {28 * 28 * 4}")
            if not keys:
                fail(
                    f"{name} without --multimodal-keys",
                    "it sizes images, and no images are read",
                    'add --multimodal-keys \'{"image": "images"}\', or drop the flag',
                )
        cp = run.train.model.context_parallel_size
        if keys and cp > 1:
            fail(
                f"--multimodal-keys with --context-parallel-size {cp}",
                "context parallelism cuts each sample over CP ranks, and no backend here cuts a sample's image "
                "tokens and pixels with its text (the FSDP backend has no CP; the Megatron backend's CP needs "
                "transformer-engine and cuts token ids only)",
                "use --context-parallel-size 1 (for samples too long for one rank, lower --max-pixels)",
            )
        if keys:
            self._check_paths_built(run)
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            fail(
                f"--min-pixels {self.min_pixels} with --max-pixels {self.max_pixels}",
                "the smallest size is above the largest",
                "make --min-pixels <= --max-pixels",
            )

    def _check_paths_built(self, run) -> None:
        """Images reach the model only on the paths built and tested (docs/design.md "Images"):
        any other would drop them silently, so it is refused."""
        unbuilt = (
            ("--rollout-engine sglang", run.rollout.engine.engine == "sglang", "--rollout-engine hf or vllm"),
            (
                "--train-backend megatron at --pipeline-model-parallel-size > 1",
                run.train.train_backend == "megatron" and run.train.model.pipeline_model_parallel_size > 1,
                "--pipeline-model-parallel-size 1 (Megatron's vision tower runs whole on each rank)",
            ),
            (
                "--train-backend megatron with --lora-rank",
                run.train.train_backend == "megatron" and run.train.lora.lora_rank > 0,
                "--train-backend fsdp (LoRA with images is built there)",
            ),
            (
                "--train-backend megatron with --sequence-parallel",
                run.train.train_backend == "megatron" and run.train.model.sequence_parallel,
                "no --sequence-parallel (Megatron's vision tower runs whole on each rank)",
            ),
            ("--advantage-estimator ppo", run.critic.enabled, "a group estimator (no VL value model is built)"),
            (
                "--true-on-policy-mode",
                run.true_on_policy.mode,
                "the default kernels (the invariant ops cover no vision tower; VL generation is generate's)",
            ),
        )
        for name, on, fix in unbuilt:
            if on:
                fail(
                    f"--multimodal-keys with {name}",
                    'images reach the model only on the paths built and tested (docs/design.md "Images"); '
                    "this path would drop them",
                    f"use {fix}, or drop --multimodal-keys",
                )
