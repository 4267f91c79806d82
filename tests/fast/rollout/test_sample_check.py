"""The checks of what a hook returned (``rl_plugin.rollout.sample_check``): each rule refuses the
first offending sample naming the hook, the sample and the rule; ``hold_to_limits`` cuts to the
model-token budget and the context and counts; behaviour log-probs and an untrainable rollout are
refused; repeated objects refused, repeated groups counted."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rl_plugin.rollout.sample import Sample
from rl_plugin.rollout.sample_check import (
    LOG_PROB_TOL,
    SampleError,
    check_distinct,
    check_log_probs,
    check_samples,
    check_trainable,
    describe_sample,
    duplicate_groups,
    hold_to_limits,
)

HOOK = "--custom-generate-function-path hooks.py:gen"


def _sample(tokens, r, mask=None, group=0, prompt="1 2 =", lp=None):
    return Sample(
        group_index=group,
        prompt=prompt,
        tokens=list(tokens),
        response_length=r,
        loss_mask=mask,
        rollout_log_probs=[-0.5] * r if lp is None else lp,
    )


def _refused(samples, vocab=16):
    with pytest.raises(SampleError) as info:
        check_samples(samples, HOOK, vocab)
    return str(info.value)


def test_good_samples_pass_and_come_back_as_a_list():
    samples = (_sample([1, 5, 3, 7, 2], 2), _sample([1, 6, 3, 8], 1, mask=[0]))
    assert check_samples(samples, HOOK, 16) == list(samples)


def test_describe_sample_cuts_long_prompts():
    s = _sample([1, 2], 1, group=3, prompt="x" * 70)
    assert describe_sample(s, 5) == f"sample 5 (group 3, prompt {'x' * 57 + '...'!r})"


def test_each_rule_names_the_hook_the_sample_and_the_rule():
    ok = _sample([1, 5, 3, 7], 1)
    msg = _refused([ok, {"tokens": [1]}])
    assert msg.startswith(f"{HOOK} returned builtins.dict for sample 1; it must return the rl_plugin.rollout.Sample")

    aborted = _sample([1, 5, 3, 7], 1)
    aborted.status = Sample.Status.ABORTED
    assert _refused([ok, aborted]) == f"{HOOK}: sample 1 (group 0, prompt '1 2 ='): status ABORTED; " + (
        "an aborted generation cannot be trained on (retry it in the hook)"
    )
    assert "tokens must be a list of ids and response_length an int, got tuple and 1" in _refused(
        [_sample([1, 2], 1).__class__(tokens=(1, 2), response_length=1, rollout_log_probs=[0.0])]
    )
    assert "got list and True" in _refused([_sample([1, 2], True)])
    assert "response_length = 4 with 4 tokens; it must count the response ids" in _refused(
        [ok, _sample([1, 5, 3, 7], 4)]
    )
    assert "response_length = 0 with 3 tokens" in _refused([_sample([1, 5, 3], 0)])
    assert "sample 1 (group 0, prompt '1 2 ='): loss_mask has 1 entries for response_length 2" in _refused(
        [ok, _sample([1, 5, 3, 7], 2, mask=[1])]
    )
    none_lp = _sample([1, 5, 3, 7], 2)
    none_lp.rollout_log_probs = None
    assert "rollout_log_probs is None for response_length 2" in _refused([none_lp])
    assert "rollout_log_probs is 3 entries for response_length 2" in _refused([_sample([1, 5, 3, 7], 2, lp=[0.0] * 3)])
    assert "loss_mask holds 0.5; it must be 0 (conditioned on) or 1 (trained)" in _refused(
        [ok, _sample([1, 5, 3, 7], 2, mask=[1, 0.5])]
    )
    assert "tokens must be ints (prompt ids + response ids), found float64 values" in _refused(
        [_sample([1.0, 5.0, 3.0], 1)]
    )
    msg = _refused([ok, _sample([1, 5, 3, 16, 2], 2)])
    assert msg == (
        f"{HOOK}: sample 1 (group 0, prompt '1 2 ='): tokens[3] = 16 is outside the model's vocabulary [0, 16); "
        "append ids of the run's tokenizer"
    )
    assert "sample 0 (group 0, prompt '1 2 ='): tokens[0] = -1 is outside" in _refused([_sample([-1, 5, 3], 1)])


def test_the_same_object_twice_is_refused_naming_both_places():
    a, b = _sample([1, 5, 3, 7], 1), _sample([1, 6, 3, 7], 1)
    check_distinct([a, b, copy.deepcopy(a), copy.deepcopy(b)], HOOK, 2)
    with pytest.raises(SampleError, match=r": samples 0 and 1 \(group 0\) are the same Sample object"):
        check_distinct([a, a, b, copy.deepcopy(b)], HOOK, 2)
    with pytest.raises(SampleError, match=r"samples 0 and 2 \(groups 0 and 1: a whole group returned twice\?\)"):
        check_distinct([a, b, a, b], HOOK, 2)


def test_repeated_groups_are_counted_in_any_order_within_the_group():
    a, b, c = [1, 5, 3, 7], [1, 6, 3, 8], [1, 4, 3, 9]
    samples = [_sample(t, 1) for t in (a, b, b, a, a, c, a, b)]
    assert duplicate_groups(samples, 2) == 2  # groups (a,b), (b,a), (a,c), (a,b): two repeat the first
    assert duplicate_groups(samples[:4], 4) == 0


def test_hold_to_limits_cuts_to_the_model_token_budget_not_the_tool_tokens(capsys):
    # 2 prompt ids; response: model 2, tool 3 (masked), model 3 = 5 model tokens, 8 in all
    mask = [1, 1, 0, 0, 0, 1, 1, 1]
    s = _sample([1, 3] + list(range(4, 12)), 8, mask=mask, lp=[-0.1 * k for k in range(8)])
    s.rollout_routed_experts = np.arange(9)
    fine = _sample([1, 3, 7], 1)
    counts = hold_to_limits([fine, s], max_model_tokens=3, context_len=None)
    assert counts == {"rollout/cut_to_response_len": 1.0, "rollout/cut_to_context": 0.0}
    # keeps the tokens before the 4th model token: 2 model + 3 tool + 1 model = 6
    assert s.response_length == 6 and s.tokens == [1, 3, 4, 5, 6, 7, 8, 9]
    assert s.loss_mask == mask[:6] and s.rollout_log_probs == pytest.approx([-0.1 * k for k in range(6)])
    assert s.rollout_routed_experts.tolist() == list(range(7))
    assert s.status is Sample.Status.TRUNCATED and s.response == ""
    assert fine.response_length == 1 and fine.status is Sample.Status.PENDING


def test_hold_to_limits_cuts_to_the_context_and_refuses_a_prompt_that_fills_it():
    s = _sample([1, 5, 6, 3, 7, 8, 9, 2], 4)  # 4 prompt + 4 response = 8 tokens
    counts = hold_to_limits([s], max_model_tokens=100, context_len=6)
    assert counts == {"rollout/cut_to_response_len": 0.0, "rollout/cut_to_context": 1.0}
    assert s.tokens == [1, 5, 6, 3, 7, 8] and s.response_length == 2 and s.loss_mask is None
    full = _sample([1, 5, 6, 3, 7], 1, group=2)
    with pytest.raises(SampleError) as info:
        hold_to_limits([full], max_model_tokens=100, context_len=4)
    assert str(info.value) == (
        "sample 0 (group 2, prompt '1 2 ='): its prompt holds 4 ids, the model's whole context (4); no response "
        "token fits. Fix: shorten the prompt (or the conversation the hook builds)"
    )


def test_behaviour_log_probs_must_be_finite_and_at_most_the_tolerance_on_trained_tokens():
    samples = [_sample([1, 5, 3, 7, 2], 2), _sample([1, 6, 3, 8, 9, 2], 3)]
    rl = torch.tensor([2, 3])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    check_log_probs(torch.tensor([-1.0, LOG_PROB_TOL, -0.2, 5.0, 0.0]), mask, rl, samples, "the hf engine")
    with pytest.raises(SampleError) as info:
        check_log_probs(torch.tensor([-1.0, 0.0, -0.2, -0.1, 0.5]), mask, rl, samples, "the hf engine")
    assert str(info.value).startswith(
        "the hf engine: sample 1 (group 0, prompt '1 2 ='): rollout_log_probs[2] = 0.5; a behaviour log-prob"
    )
    with pytest.raises(SampleError, match=r"sample 1 .*rollout_log_probs\[1\] = nan"):  # masked: still refused
        check_log_probs(torch.tensor([-1.0, 0.0, -0.2, float("nan"), 0.0]), mask, rl, samples, "hook")
    with pytest.raises(SampleError, match=r"sample 0 .*rollout_log_probs\[0\] = -inf"):
        check_log_probs(torch.tensor([-float("inf"), 0.0, -0.2, -1.0, 0.0]), mask, rl, samples, "hook")


def test_a_rollout_with_no_trained_token_is_refused():
    check_trainable(torch.tensor([0.0, 1.0]), "hook", 2)
    for mask in (torch.zeros(3), torch.zeros(0)):
        with pytest.raises(SampleError, match=r"^hook: all 2 samples of the rollout have loss mask 0 on every"):
            check_trainable(mask, "hook", 2)
