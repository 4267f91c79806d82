"""``check_same_model`` (``rl_plugin.checkpoint.compat``): one line naming the checkpoint, the model,
the first tensor that differs and the counts, before anything is loaded."""

from __future__ import annotations

import pytest

from rl_plugin.checkpoint.compat import CheckpointMismatchError, check_same_model

MODEL = {"embed": (100, 16), "layer.0.w": (16, 16), "head": (100, 16)}


def test_the_same_shapes_pass_and_ignored_names_are_not_compared():
    assert check_same_model("ck", "m", {k: list(v) for k, v in MODEL.items()}, MODEL) is None  # lists from JSON
    assert check_same_model("ck", "m", {**MODEL, "rope.inv_freq": (8,)}, MODEL, ignore=["rope.inv_freq"]) is None


def test_a_shape_difference_is_named_first_with_every_count():
    saved = {"embed": (200, 16), "layer.0.w": (16, 32), "extra": (1,)}
    with pytest.raises(CheckpointMismatchError) as err:
        check_same_model("/ck/iter_0000003", "Qwen/small", saved, MODEL)
    assert str(err.value) == (
        "--load /ck/iter_0000003: the checkpoint holds another model than --hf-checkpoint Qwen/small: embed is "
        "(200, 16) in the checkpoint and (100, 16) in the model (2 tensors differ in shape, 1 missing, 1 unexpected). "
        "Fix: pass the --hf-checkpoint the checkpoint was trained from, or start a new run without --load"
    )


def test_missing_before_unexpected_sorted_by_name():
    with pytest.raises(
        CheckpointMismatchError, match=r"the model's head is not in the checkpoint \(0 .*, 2 missing, 0"
    ):
        check_same_model("ck", "m", {"embed": (100, 16)}, MODEL)  # head and layer.0.w missing: head first
    with pytest.raises(
        CheckpointMismatchError, match=r"the checkpoint's a\.extra is not in the model \(0 .*, 0 missing, 2"
    ):
        check_same_model("ck", "m", {**MODEL, "z.extra": (1,), "a.extra": (2,)}, MODEL)
