"""The fully asynchronous schedule (``rl_plugin.loop.fully_async_schedule``): take a rollout from
the worker, train, publish every ``--update-weights-interval`` and before an eval; a resumed
pending rollout trained first."""

from __future__ import annotations

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.fully_async_schedule import FullyAsyncSchedule
from tests.support.schedules import FakeData, FakeLoop, ScheduleCfg, run_rollouts


def test_fully_async_takes_trains_and_publishes_every_interval_and_before_an_eval():
    loop = FakeLoop()
    schedule = FullyAsyncSchedule(loop, ScheduleCfg(5, interval=2, eval_at={2}))
    run_rollouts(schedule, 5)
    assert loop.calls == [
        ("take", 0), ("train", 0, False), ("finish", 0, None),
        ("take", 1), ("train", 1, True), ("finish", 1, None),
        ("take", 2), ("train", 2, True), ("finish", 2, None),  # the eval after rollout 2 loads them
        ("take", 3), ("train", 3, True), ("finish", 3, None),
        ("take", 4), ("train", 4, False), ("finish", 4, None),  # the last: nothing loads them
    ]  # fmt: skip
    assert schedule.pending() is None
    assert {"time/trainer_wait_generate", "time/train"} <= set(loop.finished[0])


def test_fully_async_trains_a_resumed_pending_rollout_first():
    loop = FakeLoop()
    schedule = FullyAsyncSchedule(loop, ScheduleCfg(4))
    schedule.resume(PendingRollout(2, FakeData(2), 0))
    run_rollouts(schedule, 4, start=2)
    assert [c[:2] for c in loop.calls if c[0] in ("take", "train")] == [("train", 2), ("take", 3), ("train", 3)]
