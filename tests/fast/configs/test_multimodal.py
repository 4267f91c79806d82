"""The image flags' own rules (``rl_plugin.configs.multimodal``): --multimodal-keys' JSON, which media
are read, the pixel bounds (positive, ordered, only with images)."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args, run_config_of
from tests.support.flag_rules import assert_refused

KEYS = '--multimodal-keys {"image":"images"} --train-backend fsdp'

UNBUILT = [
    ("--rollout-engine sglang", "use --rollout-engine hf or vllm"),
    ("--train-backend megatron --pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2", "whole on each rank"),
    ("--train-backend megatron --lora-rank 8", "LoRA with images is built there"),
    (
        "--train-backend megatron --tensor-model-parallel-size 2 --sequence-parallel --actor-num-gpus-per-node 2",
        "whole on each rank",
    ),
    ("--advantage-estimator ppo", "no VL value model is built"),
    ("--true-on-policy-mode", "the invariant ops cover no vision tower"),
]

RULES = [
    *[
        (f"{KEYS} {flags}", [f"--multimodal-keys with {flags.split()[0]}", "this path would drop them", fix])
        for flags, fix in UNBUILT
    ],
    (
        '--multimodal-keys {"video":"clips"}',
        ["--multimodal-keys", "media type video is not read (rl_plugin reads image)", "map only images"],
    ),
    (f"{KEYS} --max-pixels 0", ["--max-pixels: must be >= 1 (got 0)"]),
    ("--max-pixels 3136", ["--max-pixels without --multimodal-keys", "no images are read", "add --multimodal-keys"]),
    ("--min-pixels 3136", ["--min-pixels without --multimodal-keys"]),
    (
        f"{KEYS} --min-pixels 12544 --max-pixels 3136",
        ["--min-pixels 12544 with --max-pixels 3136", "make --min-pixels <= --max-pixels"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize("value", ["notjson", "[1]", "{}", '{"image":""}'])
def test_keys_must_be_a_json_object_of_record_keys(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--multimodal-keys", value])
    assert "--multimodal-keys" in capsys.readouterr().err


def test_the_run_config_carries_the_image_key_and_pixel_bounds():
    args = parse_args([*KEYS.split(), "--min-pixels", "3136", "--max-pixels", "12544"])
    mm = run_config_of(args).rollout.multimodal
    assert (mm.image_key, mm.min_pixels, mm.max_pixels) == ("images", 3136, 12544)
    assert run_config_of(parse_args([])).rollout.multimodal.image_key is None


def test_freeze_vision_tower_needs_images():
    """``--freeze-vision-tower`` (TrainConfig) freezes a tower only a run with images has."""
    assert_refused(
        "--freeze-vision-tower",
        ["--freeze-vision-tower without --multimodal-keys", "the run reads no images", "add --multimodal-keys"],
    )
    args = parse_args([*KEYS.split(), "--freeze-vision-tower"])
    assert run_config_of(args).train.freeze_vision_tower is True


def test_context_parallelism_with_images_is_refused_naming_both_flags():
    """No backend cuts a sample's image tokens over CP ranks (FSDP has no CP at all, refused by
    ``TrainConfig`` first; Megatron's needs transformer-engine and cuts token ids only)."""
    assert_refused(
        '--multimodal-keys {"image":"images"} --train-backend megatron --context-parallel-size 2 --actor-num-gpus-per-node 2',
        [
            "--multimodal-keys with --context-parallel-size 2",
            "no backend here cuts a sample's image tokens and pixels with its text",
            "Fix: use --context-parallel-size 1",
        ],
    )
    assert_refused(
        '--multimodal-keys {"image":"images"} --train-backend fsdp --context-parallel-size 2',
        ["--train-backend fsdp with --context-parallel-size 2", "or set it to 1"],
    )


def test_vllm_takes_images_and_gets_the_runs_pixel_bounds():
    """Issue 46: the vllm engine generates from images; vLLM's processor gets --min/--max-pixels."""
    args = parse_args([*KEYS.split(), "--rollout-engine", "vllm", "--max-pixels", "12544"])
    run = run_config_of(args)
    run.rollout.multimodal.check(run)  # not refused
    assert run.rollout.engine.pixel_bounds == (None, 12544)
    assert run_config_of(parse_args(["--rollout-engine", "vllm"])).rollout.engine.pixel_bounds is None
