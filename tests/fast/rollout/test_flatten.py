"""The rollout manager's per-rollout work without per-sample Python loops, checked against the
per-sample code it replaced (kept here as the reference): the flat tensors from the engine's
generations and reward scoring with its error precedence.
Exact equality: the same values are copied or compared, no arithmetic beyond the one
double -> fp32 rounding, which both paths do to nearest."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rl_plugin.rollout.data.task import digit_match_reward
from rl_plugin.rollout.engines.base import Generation
from rl_plugin.rollout.flatten import flatten_samples
from rl_plugin.rollout.rewards.functions import RewardFunctionError, score_responses
from tests.support.samples import samples_of


def _generations(seed: int):
    rng = random.Random(seed)
    gens = []
    for _ in range(37):
        prompt = [1] + [rng.randrange(4, 14) for _ in range(rng.randrange(1, 9))]
        response = [rng.randrange(0, 14) for _ in range(rng.randrange(1, 6))]
        log_probs = [-rng.random() * 7 for _ in response]  # doubles: fp32 rounding is exercised
        gens.append(Generation(prompt, response, log_probs, rng.random() < 0.3))
    return gens


def test_flatten_samples_equals_the_per_sample_path():
    gens = _generations(0)
    flat = flatten_samples(samples_of(gens))
    ref_tokens = torch.tensor([t for g in gens for t in g.prompt_ids + g.response_ids], dtype=torch.long)
    ref_lp = torch.tensor([x for g in gens for x in g.log_probs], dtype=torch.float32)
    ref_rl = torch.tensor([len(g.response_ids) for g in gens], dtype=torch.long)
    ref_tl = torch.tensor([len(g.prompt_ids) + len(g.response_ids) for g in gens], dtype=torch.long)
    for got, ref in (
        (flat.tokens, ref_tokens),
        (flat.log_probs, ref_lp),
        (flat.response_lengths, ref_rl),
        (flat.total_lengths, ref_tl),
    ):
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    assert flat.truncated_frac == float(sum(not g.finished for g in gens) / len(gens))


def test_digit_match_unchanged():
    for response, label, want in (("413", "413", 1.0), ("41", "413", 2 / 3), ("4139", "413", 3 / 4), ("", "", 1.0)):
        assert digit_match_reward(response, label) == want


def test_scoring_calls_once_in_order_and_names_the_first_bad_sample():
    calls = []

    def fn(p, r, lab):
        calls.append(p)
        return {"a": 0.5, "b": 0.25, "c": 1}[p]

    assert score_responses(fn, ["a", "b", "c"], ["", "", ""], [0, 0, 0]) == [0.5, 0.25, 1.0]
    assert calls == ["a", "b", "c"]
    # a string or a bool is not taken for a number (issue 38): named, not coerced
    for value, shown in (("0.25", r"'0.25' \(str\)"), (True, r"True \(bool\)")):
        with pytest.raises(ValueError, match=rf"returned {shown} for sample 1 \(prompt 'b'\)"):
            score_responses(lambda p, r, lab, v=value: {"a": 0.5, "b": v}[p], ["a", "b"], ["", ""], [0, 0])
    bad = {"ok": 1.0, "nan": math.nan, "str": "x"}

    def raising(p, r, lab):
        if p == "boom":
            raise KeyError("k")
        return bad[p]

    # an earlier bad value is named before a later raise, as the per-sample loop did
    with pytest.raises(ValueError, match=r"returned nan for sample 1 \(prompt 'nan'"):
        score_responses(raising, ["ok", "nan", "boom"], ["", "", ""], [0, 0, 0])
    with pytest.raises(ValueError, match=r"returned 'x' \(str\) for sample 1 \(prompt 'str'\); it must return a float"):
        score_responses(raising, ["ok", "str", "nan"], ["", "", ""], [0, 0, 0])
    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'k' .*on sample 1 of the rollout"):
        score_responses(raising, ["ok", "boom", "nan"], ["", "", ""], [0, 0, 0])
