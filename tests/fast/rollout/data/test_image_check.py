"""The start-up check of a run with images: every refusal names the file:line or the flag, through the
flag checker (``python -m rl_plugin.arguments``, the trainer's preflight runs the same function)."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments.__main__ import main as checker
from rl_plugin.rollout.data.vl_task import write_colour_task
from tests.support.tiny_vl import COLOUR_TASK_FLAGS, tiny_vl_dir


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_vl_dir(tmp_path_factory.mktemp("vl")))


def _flags(model, data, *extra):
    return [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        *COLOUR_TASK_FLAGS,
        "--rollout-batch-size",
        "2",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "2",
        *extra,
    ]


def _refusal(capsys, flags) -> str:
    rc = checker(flags)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Fix:" in err
    return err


def _data(tmp_path, n=3):
    train, _ = write_colour_task(tmp_path, num_train=n, num_eval=1)
    return train, [json.loads(line) for line in train.read_text().splitlines()]


def test_good_data_passes(capsys, ckpt, tmp_path):
    train, _ = _data(tmp_path)
    assert checker(_flags(ckpt, train)) == 0, capsys.readouterr().err


def test_a_missing_image_names_its_file_and_line(capsys, ckpt, tmp_path):
    train, _ = _data(tmp_path)
    (tmp_path / "images" / "train_00001.png").unlink()
    err = _refusal(capsys, _flags(ckpt, train))
    assert f"--prompt-data {train}:2: image 0 of 'images' (--multimodal-keys):" in err
    assert "train_00001.png: no such file" in err


def test_an_undecodable_image_names_its_file_and_line(capsys, ckpt, tmp_path):
    train, _ = _data(tmp_path)
    (tmp_path / "images" / "train_00002.png").write_bytes(b"\x89PNG broken")
    err = _refusal(capsys, _flags(ckpt, train))
    assert f"--prompt-data {train}:3: image 0 of 'images'" in err and "is not a readable image" in err


def test_a_record_without_its_images_key(capsys, ckpt, tmp_path):
    train, recs = _data(tmp_path)
    del recs[1]["images"]
    train.write_text("".join(json.dumps(r) + "\n" for r in recs))
    err = _refusal(capsys, _flags(ckpt, train))
    assert f"{train}:2: no key 'images' (--multimodal-keys)" in err


def test_image_tokens_past_the_context_are_refused_with_the_pixels_that_fit(capsys, ckpt, tmp_path):
    from PIL import Image

    train, _ = _data(tmp_path)
    Image.new("RGB", (448, 448)).save(tmp_path / "images" / "train_00000.png")  # 16 image tokens at max-pixels
    flags = _flags(ckpt, train, "--rollout-max-context-len", "60")
    err = _refusal(capsys, flags)
    assert f"--prompt-data {train}:1: the prompt is 64 tokens (16 of them image tokens)" in err
    assert "more than the context of 60 (--rollout-max-context-len" in err
    assert "lower --max-pixels to 6272 (8 image tokens for its 1 images)" in err
    # at that bound it fits
    assert checker(flags + ["--max-pixels", "6272", "--min-pixels", "784"]) == 0, capsys.readouterr().err


def test_a_text_only_checkpoint_with_multimodal_keys(capsys, tiny_qwen2, tmp_path):
    train, _ = _data(tmp_path)
    err = _refusal(capsys, _flags(tiny_qwen2, train))
    assert f"--multimodal-keys with --hf-checkpoint {tiny_qwen2}: that checkpoint is a text-only model" in err
    assert "model_type 'qwen2'" in err and "drop --multimodal-keys" in err


def test_a_vision_language_family_not_trained_here(capsys, ckpt, tmp_path):
    """A checkpoint with a vision tower of another family (here: the tiny VL's config relabelled as
    LLaVA) is refused as such, not as text-only."""
    import shutil

    other = tmp_path / "llava"
    shutil.copytree(ckpt, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    train, _ = _data(tmp_path)
    err = _refusal(capsys, _flags(other, train))
    assert f"--multimodal-keys with --hf-checkpoint {other}: its vision-language family (model_type 'llava')" in err
    assert "qwen2_5_vl, qwen2_vl" in err and "convert the model to a Qwen2-VL / Qwen2.5-VL checkpoint" in err
