"""``SampleScorer``'s reward forms with real files loaded through the user-code loader
(``--custom-rm-path file.py:fn``): slime's ``async def rm(args, sample)`` (all samples
concurrently), ``--group-rm``'s ``rm(args, samples)`` (once per contiguous group, groups
concurrently), the three-argument form through the unchanged ``score_responses``, and the
fail-loud checks naming file:line and the sample or group."""

from __future__ import annotations

import argparse
import asyncio
import threading

import pytest

from rl_plugin.rollout.rewards.functions import RewardFunctionError, load_reward_fn, score_responses
from rl_plugin.rollout.rewards.scorer import GROUP, PROMPT_RESPONSE_LABEL, SAMPLE, SampleScorer
from rl_plugin.rollout.sample import Sample

SLIME_RM = """
import asyncio

RUNNING = [0, 0]  # now, most at once

async def rm(args, sample):
    RUNNING[0] += 1
    RUNNING[1] = max(RUNNING)
    await asyncio.sleep(0.02)
    RUNNING[0] -= 1
    if sample.label == "boom":
        raise KeyError("no_such_field")
    if args.reward_key:
        return {args.reward_key: len(sample.response) + sample.metadata["bonus"], "tag": sample.prompt}
    return len(sample.response) + sample.metadata["bonus"]


def sync_rm(args, sample):
    return float(sample.response == sample.label)


def three(prompt, response, label):
    return float(response == label)


async def nan_rm(args, sample):
    return float("nan") if sample.index == 3 else 0.0
"""

GROUP_RM = """
import asyncio

CALLS = []
RUNNING = [0, 0]

async def rm(args, samples):
    CALLS.append([s.index for s in samples])
    RUNNING[0] += 1
    RUNNING[1] = max(RUNNING)
    await asyncio.sleep(0.02)
    RUNNING[0] -= 1
    if len({s.label for s in samples}) != 1:
        raise ValueError("a group mixes prompts")
    best = max(len(s.response) for s in samples)
    return [float(len(s.response) == best) for s in samples]


async def short(args, samples):
    return [1.0]
"""


def _args(path, **kw):
    base = dict(
        rm_type=None,
        custom_rm_path=path,
        group_rm=False,
        reward_key=None,
        rm_url=None,
        rm_timeout=None,
        n_samples_per_prompt=4,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _samples(groups=3, n=4, label=None):
    return [
        Sample(
            group_index=g,
            index=g * n + j,
            prompt=f"q{g}",
            response="y" * (j + g),
            label=label or f"L{g}",
            metadata={"bonus": 0.5},
        )
        for g in range(groups)
        for j in range(n)
    ]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "slime_rm.py").write_text(SLIME_RM)
    (tmp_path / "group_rm.py").write_text(GROUP_RM)
    return tmp_path


def test_slime_sample_form_runs_all_samples_concurrently(files):
    scorer = SampleScorer(_args(f"{files}/slime_rm.py:rm"))
    assert scorer.form == SAMPLE
    samples = _samples()
    out = scorer.score_samples(samples)
    assert out == [len(s.response) + 0.5 for s in samples] == [s.reward for s in samples]
    assert scorer.fn.fn.__globals__["RUNNING"][1] == len(samples)  # every call in flight at once


def test_slime_form_dict_reward_with_reward_key(files):
    samples = _samples(1)
    out = SampleScorer(_args(f"{files}/slime_rm.py:rm", reward_key="acc")).score_samples(samples)
    assert out == [0.5, 1.5, 2.5, 3.5]
    assert samples[1].reward == {"acc": 1.5, "tag": "q0"}  # kept whole


def test_sync_slime_form_and_the_three_argument_form(files):
    samples = _samples(2, label="yy")
    assert SampleScorer(_args(f"{files}/slime_rm.py:sync_rm")).form == SAMPLE
    assert SampleScorer(_args(f"{files}/slime_rm.py:sync_rm")).score_samples(samples) == [0, 0, 1, 0, 0, 1, 0, 0]
    three = SampleScorer(_args(f"{files}/slime_rm.py:three"))
    assert three.form == PROMPT_RESPONSE_LABEL and three.sync
    assert three.score_samples(samples) == [0, 0, 1, 0, 0, 1, 0, 0] == [s.reward for s in samples]


def test_three_argument_errors_are_score_responses_own(files):
    (files / "bad.py").write_text("def reward(prompt, response, label):\n    return {'x': 1}[response]\n")
    spec = f"{files}/bad.py:reward"
    samples = _samples(1)
    with pytest.raises(RewardFunctionError) as mine:
        SampleScorer(_args(spec)).score_samples(samples)
    with pytest.raises(RewardFunctionError) as theirs:
        score_responses(load_reward_fn(None, spec), ["q0"] * 4, [s.response for s in samples], ["L0"] * 4, [{}] * 4)
    assert str(mine.value) == str(theirs.value)
    assert f"at {files}/bad.py:2" in str(mine.value) and "sample 0 of the rollout (prompt 'q0'" in str(mine.value)


def test_builtin_rewards_go_through_the_scorer():
    samples = [Sample(prompt="12=", response="12", label="12"), Sample(prompt="7=", response="70", label=7)]
    scorer = SampleScorer(_args(None, rm_type="digit_match"))
    assert scorer.sync and scorer.score_samples(samples) == [1.0, 0.5]


def test_slime_form_raise_names_file_line_and_sample(files):
    samples = _samples(1)
    samples[2].label = "boom"
    with pytest.raises(RewardFunctionError) as err:
        SampleScorer(_args(f"{files}/slime_rm.py:rm")).score_samples(samples)
    msg = str(err.value)
    assert f"--custom-rm-path {files}/slime_rm.py:rm raised KeyError: 'no_such_field' at {files}/slime_rm.py:12" in msg
    assert "on sample 2 of the rollout (prompt 'q0', response 'yy', label 'boom')" in msg and "rm(args, sample)" in msg


def test_non_finite_reward_names_the_sample(files):
    with pytest.raises(ValueError, match=r"slime_rm.py:nan_rm returned nan for sample 3 \(prompt 'q0'"):
        SampleScorer(_args(f"{files}/slime_rm.py:nan_rm")).score_samples(_samples(2))


def test_group_rm_once_per_contiguous_group_all_groups_concurrently(files):
    scorer = SampleScorer(_args(f"{files}/group_rm.py:rm", group_rm=True))
    assert scorer.form == GROUP
    samples = _samples(groups=3, n=4)
    out = scorer.score_samples(samples)
    assert out == [0, 0, 0, 1] * 3 == [s.reward for s in samples]
    module = scorer.fn.fn.__globals__
    assert sorted(module["CALLS"]) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert module["RUNNING"][1] == 3
    # eval rollouts have their own group size
    module["CALLS"].clear()
    scorer.score_samples(_samples(groups=2, n=2), group_size=2)
    assert sorted(module["CALLS"]) == [[0, 1], [2, 3]]


def test_group_rm_errors_name_the_group(files):
    with pytest.raises(RewardFunctionError) as err:
        SampleScorer(_args(f"{files}/group_rm.py:short", group_rm=True)).score_samples(_samples(2))
    assert "returned 1 rewards for group 0 of the rollout (samples 0..3, prompt 'q0')" in str(err.value)
    assert f"{files}/group_rm.py:" in str(err.value) and "a list of 4 rewards" in str(err.value)
    with pytest.raises(RewardFunctionError) as err:  # groups of 4 that are not the prompts' groups
        SampleScorer(_args(f"{files}/group_rm.py:rm", group_rm=True, n_samples_per_prompt=4)).score_samples(
            _samples(groups=4, n=2)
        )
    assert "raised ValueError: a group mixes prompts at" in str(err.value) and "group 0" in str(err.value)


def test_group_rm_with_a_per_sample_signature_is_refused(files):
    with pytest.raises(RewardFunctionError) as err:
        SampleScorer(_args(f"{files}/slime_rm.py:three", group_rm=True))
    msg = str(err.value)
    assert msg.startswith(f"--group-rm with --custom-rm-path {files}/slime_rm.py:three:")
    assert "three(prompt, response, label)" in msg and "Fix: write it as `async def rm(args, samples)" in msg


def test_score_samples_from_a_thread_and_inside_a_loop(files):
    scorer = SampleScorer(_args(f"{files}/slime_rm.py:rm"))
    got = []
    t = threading.Thread(target=lambda: got.append(scorer.score_samples(_samples(1))))
    t.start()
    t.join()
    assert got == [[0.5, 1.5, 2.5, 3.5]]

    async def in_loop():
        with pytest.raises(RuntimeError, match="inside a running event loop"):
            scorer.score_samples(_samples(1))
        return await scorer.score(_samples(1))

    assert asyncio.run(in_loop()) == [0.5, 1.5, 2.5, 3.5]


def test_manager_builds_the_samples_of_a_rollout():
    from rl_plugin.rollout.data.dataset import PromptRecord
    from rl_plugin.rollout.engines.base import Generation
    from rl_plugin.rollout.generation.default import build_samples

    recs = [PromptRecord("12=", "12", 0), PromptRecord([{"role": "user", "content": "hi"}], 7, 1, metadata={"w": 1})]
    gens = [
        Generation([1, 5], [6, 2], [-0.1, -0.2], True),
        Generation([1, 5], [6], [-0.3], False),
        Generation([1, 9, 9], [4, 4, 2], [-0.1] * 3, True),
        Generation([1, 9, 9], [3], [-0.5], False),
    ]
    samples = build_samples(recs, gens, ["a", "b", "c", "d"], 2)
    assert [s.group_index for s in samples] == [0, 0, 1, 1] and [s.index for s in samples] == [0, 1, 2, 3]
    assert [s.tokens for s in samples] == [[1, 5, 6, 2], [1, 5, 6], [1, 9, 9, 4, 4, 2], [1, 9, 9, 3]]
    assert [s.response_length for s in samples] == [2, 1, 3, 1] and [s.prompt_length for s in samples] == [2, 2, 3, 3]
    assert [s.status for s in samples] == [Sample.Status.COMPLETED, Sample.Status.TRUNCATED] * 2
    assert samples[0].metadata == {} and samples[3].metadata == {"w": 1} and samples[2].label == 7
    assert samples[2].prompt == [{"role": "user", "content": "hi"}] and samples[1].response == "b"
