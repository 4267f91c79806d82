"""A reward must be a number (issue 38): a bool or a string returned by a reward function is
refused naming the sample, not coerced (before: ``float(True) == 1.0``, ``float("0.5") == 0.5``
trained silently)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_plugin.rollout.rewards.functions import reward_number, score_responses


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
