"""A reward must be a number (issue 38): a bool or a string returned by a reward function is
refused naming the sample, not coerced (before: ``float(True) == 1.0``, ``float("0.5") == 0.5``
trained silently)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_plugin.rollout.rewards.functions import (
    REWARDS,
    extract_final_answer,
    load_reward_fn,
    reward_number,
    score_responses,
)


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), "0.5", b"1"])
def test_a_bool_or_a_string_reward_is_refused_naming_the_sample(bad):
    rewards = [0.0, bad]
    with pytest.raises(ValueError) as info:
        score_responses(lambda p, r, lab: rewards[int(p)], ["0", "1"], ["a", "b"], ["x", "y"])
    msg = str(info.value)
    assert f"reward function returned {bad!r} ({type(bad).__name__}) for sample 1 (prompt '1')" in msg, msg
    assert "a bool or a string is not taken for a number" in msg


@pytest.mark.parametrize("good", [1, 0.5, np.float32(0.5), np.int64(2), torch.tensor(0.25)])
def test_numbers_of_any_numeric_type_are_rewards(good):
    assert reward_number(good) == float(good)
    assert score_responses(lambda p, r, lab: good, ["0"], ["a"], ["x"]) == [float(good)]


def test_math_exact_and_custom_reward(tmp_path):
    fn = load_reward_fn("math_exact")
    assert fn("q", "so the answer is \\boxed{42}", "42") == 1.0
    assert fn("q", "it is 3, then 41.0", 41) == 1.0
    assert fn("q", "no number", "7") == 0.0
    assert extract_final_answer("a 1 b 2") == "2"
    (tmp_path / "rm.py").write_text("def rm(prompt, response, label):\n    return float(len(response))\n")
    custom = load_reward_fn(None, f"{tmp_path}/rm.py:rm")
    assert custom("p", "abc", None) == 3.0
    with pytest.raises(ValueError, match="--custom-rm-path 'no_such_mod:f': cannot load"):
        load_reward_fn(None, "no_such_mod:f")
    with pytest.raises(ValueError, match=r"--rm-type 'nope': unknown reward"):
        load_reward_fn("nope")
    with pytest.raises(ValueError, match=r"returned nan for sample 1 \(prompt 'b'"):
        score_responses(lambda p, r, _label: float("nan") if p == "b" else 0.0, ["a", "b"], ["", ""], [None, None])
    assert set(REWARDS) >= {"digit_match", "math_exact"}
