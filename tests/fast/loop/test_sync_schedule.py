"""The synchronous schedule (``rl_plugin.loop.sync_schedule``): generate, then train each rollout,
publishing when a later generate loads the weights."""

from __future__ import annotations

from rl_plugin.loop.sync_schedule import SyncSchedule
from tests.support.schedules import FakeLoop, ScheduleCfg, run_rollouts


def test_sync_generates_then_trains_each_rollout():
    loop = FakeLoop()
    schedule = SyncSchedule(loop, ScheduleCfg(3))
    run_rollouts(schedule, 3)
    assert loop.calls == [
        ("generate", 0), ("train", 0, True), ("finish", 0, None),
        ("generate", 1), ("train", 1, True), ("finish", 1, None),
        ("generate", 2), ("train", 2, False), ("finish", 2, None),
    ]  # fmt: skip
    assert schedule.pending() is None
    assert set(loop.finished[0]) == {"time/rollout_call", "time/train"}
