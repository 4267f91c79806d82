"""The overlapped schedule (``rl_plugin.loop.overlapped_schedule``, ``--max-weight-staleness 1``):
rollout k + 1 generated while k trains, the rollout ahead owned (and checkpointed) as pending, its
staleness, and a failure ahead after the steps were logged."""

from __future__ import annotations

import pytest

from rl_plugin.errors import LoopError
from rl_plugin.loop.overlapped_schedule import OverlappedSchedule
from tests.support.schedules import FakeLoop, ScheduleCfg, run_rollouts


def test_overlapped_generates_one_ahead_and_owns_it():
    loop = FakeLoop()
    schedule = OverlappedSchedule(loop, ScheduleCfg(3))
    schedule.run_rollout(0)
    assert loop.calls == [
        ("generate", 0),
        ("submit_generate", 1),
        ("train", 0, True),
        ("wait_generate", 1),
        ("finish", 0, 0),
    ]
    pending = schedule.pending()  # what a checkpoint after rollout 0 holds
    assert (pending.rollout_id, pending.data.k, pending.staleness) == (1, 1, 1)
    loop.calls.clear()
    run_rollouts(schedule, 3, start=1)
    assert loop.calls == [
        ("submit_generate", 2), ("train", 1, False), ("wait_generate", 2), ("finish", 1, 1),
        ("train", 2, False), ("finish", 2, 1),
    ]  # fmt: skip
    assert schedule.pending() is None


def test_overlapped_rollout_sampled_by_a_restarted_manager_has_no_lag():
    loop = FakeLoop(restart_while_generating=1)
    schedule = OverlappedSchedule(loop, ScheduleCfg(3))
    schedule.run_rollout(0)
    assert schedule.pending().staleness == 0
    schedule.run_rollout(1)
    assert loop.calls[-1] == ("finish", 1, 0)


def test_overlapped_failure_ahead_keeps_the_steps_logged():
    loop = FakeLoop(fail_wait=1)
    schedule = OverlappedSchedule(loop, ScheduleCfg(3))
    with pytest.raises(LoopError):
        schedule.run_rollout(0)
    assert loop.calls[-1] == ("log_steps", 0, 0)
