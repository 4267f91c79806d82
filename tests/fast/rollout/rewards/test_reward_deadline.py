"""Issue 38 item 3: ``--rm-timeout`` bounds a local ``--custom-rm-path`` function too (before, only
the remote client's requests had a deadline, and a judge that never answered froze the run with
no output). Every form: slime's ``async def rm(args, sample)``, a plain ``def`` three-argument
function (run in a worker thread, left behind when stuck), ``--group-rm``."""

from __future__ import annotations

import argparse
import time

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.configs.rewards import DEFAULT_LOCAL_TIMEOUT_S
from rl_plugin.rollout.rewards.functions import RewardFunctionError
from rl_plugin.rollout.rewards.scorer import SampleScorer
from rl_plugin.rollout.sample import Sample

STUCK = """
import asyncio, time

async def rm(args, sample):
    if sample.index == 2:
        await asyncio.sleep(3600)  # a judge that never answers
    return 1.0

def three(prompt, response, label):
    if response == "yy":
        time.sleep(20)  # a plain def that blocks: left behind in its worker thread
    return 1.0

async def group(args, samples):
    if samples[0].group_index == 1:
        await asyncio.sleep(3600)
    return [1.0] * len(samples)

def ok(prompt, response, label):
    return float(len(response))
"""


def _scorer(tmp_path, fn, timeout=1.0, group_rm=False):
    path = tmp_path / "stuck_rm.py"
    path.write_text(STUCK)
    args = argparse.Namespace(
        rm_type=None,
        custom_rm_path=f"{path}:{fn}",
        group_rm=group_rm,
        reward_key=None,
        rm_url=None,
        rm_timeout=timeout,
        n_samples_per_prompt=2,
    )
    return SampleScorer(args), path


def _samples():
    return [Sample(group_index=i // 2, index=i, prompt=f"q{i}", response="y" * i, label="L") for i in range(4)]


@pytest.mark.parametrize(
    "fn, group_rm, sample, what",
    [
        ("rm", False, 2, "did not return within --rm-timeout 1 s"),
        ("three", False, 2, "did not return within --rm-timeout 1 s"),
        ("group", True, 2, "(--group-rm, group 1) did not return within --rm-timeout 1 s"),
    ],
)
def test_a_stuck_reward_stops_at_rm_timeout_naming_function_and_sample(tmp_path, fn, group_rm, sample, what):
    scorer, path = _scorer(tmp_path, fn, group_rm=group_rm)
    with pytest.raises(RewardFunctionError) as err:
        scorer.score_samples(_samples())
    msg = str(err.value)
    assert f"--custom-rm-path {path}:{fn} (defined at {path}:" in msg, msg
    assert f"{what} on sample {sample} of the rollout (group 1, prompt 'q{sample}'" in msg, msg
    assert "Fix: give the function's own waits" in msg


def test_a_plain_def_reward_still_runs_in_order_with_its_checks(tmp_path):
    scorer, _ = _scorer(tmp_path, "ok", timeout=None)
    assert scorer.timeout == DEFAULT_LOCAL_TIMEOUT_S
    assert scorer.score_samples(_samples()) == [0.0, 1.0, 2.0, 3.0]


def test_rm_timeout_is_accepted_with_a_custom_reward_and_refused_with_a_builtin(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(STUCK)
    args = parse_args(["--custom-rm-path", f"{path}:ok", "--rm-timeout", "5"])
    assert args.rm_timeout == 5.0
    with pytest.raises(RLArgumentError, match="--rm-timeout without --rm-type remote_rm or --custom-rm-path"):
        parse_args(["--rm-type", "math_exact", "--rm-timeout", "5"])


PLAIN = """
import time

def first_stuck(args, sample):
    if sample.index == 0:
        time.sleep(8)  # stuck: left behind in its worker thread
    return 1.0

def all_stuck(args, sample):
    time.sleep(4)
    return 1.0

def group_stuck(args, samples):
    if samples[0].group_index == 0:
        time.sleep(8)
    return [1.0] * len(samples)
"""


@pytest.mark.parametrize(
    "fn, group_rm, what",
    [
        ("first_stuck", False, "did not return within --rm-timeout 0.5 s on sample 0"),
        ("all_stuck", False, "did not return within --rm-timeout 0.5 s on sample 0"),
        ("group_stuck", True, "(--group-rm, group 0) did not return within --rm-timeout 0.5 s on sample 0"),
    ],
)
def test_a_stuck_plain_def_reward_does_not_hold_the_calls_queued_behind_it(tmp_path, fn, group_rm, what):
    """Issue 44 item 7: a plain ``def`` in slime's forms runs in the serial worker; when its stuck
    call was abandoned, the calls queued behind it stayed on the dead thread's queue and the scoring
    waited for the stuck call to return (8 s here; 4 x 4 s when every call is stuck). Now the
    queue moves to a fresh thread and the first deadline passed stops the scoring."""
    path = tmp_path / "plain_rm.py"
    path.write_text(PLAIN)
    args = argparse.Namespace(
        rm_type=None,
        custom_rm_path=f"{path}:{fn}",
        group_rm=group_rm,
        reward_key=None,
        rm_url=None,
        rm_timeout=0.5,
        n_samples_per_prompt=2,
    )
    scorer = SampleScorer(args)
    t0 = time.perf_counter()
    with pytest.raises(RewardFunctionError) as err:
        scorer.score_samples(_samples())
    took = time.perf_counter() - t0
    assert what in str(err.value) and f"{path}:{fn}" in str(err.value), str(err.value)
    assert took < 2.5, f"the scoring took {took:.1f} s with --rm-timeout 0.5"


def test_the_worker_serves_later_calls_after_abandoning_a_stuck_one():
    """The serial worker after a timeout: the next calls run (in order, one at a time) on a
    fresh thread while the stuck one is still running on the old."""
    import threading

    from rl_plugin.rollout.deadlines import SerialWorker, UserCallTimeout

    worker, release, order = SerialWorker("test"), threading.Event(), []

    def stuck():
        release.wait(30)
        order.append("stuck")

    with pytest.raises(UserCallTimeout, match="did not return within --x 0.2 s"):
        worker.call(stuck, timeout=0.2, what="--x")
    assert [worker.call(order.append, i, timeout=5, what="--x") for i in range(3)] == [None] * 3
    assert order == [0, 1, 2]
    release.set()
