"""The tiny Qwen2.5-VL checkpoint and the colour task's data, built once per test session under
pytest's base temporary directory (spawned ranks reach them by path)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

# the colour task's flags (``rl_plugin.rollout.data.vl_task``): its images, the chat template, its reward
COLOUR_TASK_FLAGS = (
    "--multimodal-keys",
    '{"image": "images"}',
    "--apply-chat-template",
    "--custom-rm-path",
    "rl_plugin.rollout.data.vl_task:colour_reward",
)


def tiny_vl_dir(base: Path) -> Path:
    from rl_plugin.models.tiny_vl import make_tiny_vl_checkpoint

    return make_tiny_vl_checkpoint(Path(base) / "tiny-vl")


def vl_rollout_config(**fields):
    """A ``RolloutConfig`` of a run with images (``--multimodal-keys '{"image": "images"}'``)."""
    from rl_plugin.configs.multimodal import MultimodalConfig
    from rl_plugin.configs.rollout import RolloutConfig

    mm = MultimodalConfig(
        multimodal_keys={"image": "images"},
        min_pixels=fields.pop("min_pixels", None),
        max_pixels=fields.pop("max_pixels", None),
    )
    return dataclasses.replace(RolloutConfig(), multimodal=mm, **fields)
