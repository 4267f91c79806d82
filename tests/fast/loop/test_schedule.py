"""The schedules without Ray (``rl_plugin.loop.schedule``): each runs a rollout's phases in its
order through the ``RolloutLoop`` pieces only, and owns the rollout generated ahead
(``PendingRollout``): what a checkpoint saves and a resume hands back. Each schedule's own order:
``test_sync_schedule.py``, ``test_overlapped_schedule.py``, ``test_fully_async_schedule.py``."""

from __future__ import annotations

import inspect
from dataclasses import FrozenInstanceError, replace
from typing import Dict, List

import pytest

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.errors import LoopError, StopRequested
from rl_plugin.loop.fully_async_schedule import FullyAsyncSchedule
from rl_plugin.loop.overlapped_schedule import OverlappedSchedule
from rl_plugin.loop.rollout_pieces import RolloutPieces
from rl_plugin.loop.schedule import RolloutLoop, Schedule
from rl_plugin.loop.sync_schedule import SyncSchedule
from tests.support.schedules import FakeData, FakeLoop, ScheduleCfg


def _methods(protocol) -> Dict[str, List[str]]:
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(protocol).items()
        if callable(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize("impl", [RolloutPieces, FakeLoop], ids=["RolloutPieces", "FakeLoop"])
def test_rollout_loop_is_what_the_driver_offers(impl):
    """Every piece of ``RolloutLoop`` is a method of the driver with the same parameters (a
    ``Protocol`` is not checked at run time; this keeps the two from drifting)."""
    for name, params in _methods(RolloutLoop).items():
        assert list(inspect.signature(getattr(impl, name)).parameters) == params, name


@pytest.mark.parametrize("impl", [SyncSchedule, OverlappedSchedule, FullyAsyncSchedule])
def test_schedules_implement_the_protocol(impl):
    for name, params in _methods(Schedule).items():
        assert list(inspect.signature(getattr(impl, name)).parameters) == params, name


@pytest.mark.parametrize("schedule_cls", [SyncSchedule, OverlappedSchedule])
def test_resumed_pending_is_trained_as_it_was(schedule_cls):
    """A checkpoint's rollout generated ahead is trained first, with its staleness, not generated again."""
    loop = FakeLoop()
    schedule = schedule_cls(loop, ScheduleCfg(3))
    stored = FakeData(1)
    schedule.resume(PendingRollout(1, stored, 1))
    schedule.run_rollout(1)
    if schedule_cls is SyncSchedule:
        assert loop.calls == [("train", 1, True), ("finish", 1, None)]
    else:
        assert loop.calls == [("submit_generate", 2), ("train", 1, False), ("wait_generate", 2), ("finish", 1, 1)]


def test_pending_of_another_rollout_is_refused():
    schedule = SyncSchedule(FakeLoop(), ScheduleCfg(3))
    schedule.resume(PendingRollout(2, FakeData(2), 1))
    with pytest.raises(LoopError, match="generated ahead is rollout 2, the loop is at rollout 1"):
        schedule.run_rollout(1)


def test_pending_rollout_is_frozen():
    pending = PendingRollout(1, FakeData(1), 1)
    with pytest.raises(FrozenInstanceError):
        pending.staleness = 0  # type: ignore[misc]
    assert replace(pending, staleness=0).staleness == 0


class _StopInTrain(FakeLoop):
    """A train call that an exit signal stops before its first step (``StopRequested``)."""

    def __init__(self, stop_at: int):
        super().__init__()
        self.stop_at = stop_at

    def train_rollout(self, data, sync=False):
        if data.k == self.stop_at:
            raise StopRequested("the train call stopped before its optimizer step 1 of 1")
        return super().train_rollout(data, sync)


@pytest.mark.parametrize("schedule", [SyncSchedule, OverlappedSchedule])
def test_a_rollout_cut_before_its_train_call_stays_pending(schedule):
    """Issue 38 #2: the checkpoint an exit signal writes after rollout k-1 holds rollout k (generated,
    not trained on) whichever schedule ran, so the resumed run trains on it as this one would have."""
    loop = _StopInTrain(stop_at=2)
    s = schedule(loop, ScheduleCfg(5))
    s.run_rollout(0)
    s.run_rollout(1)
    with pytest.raises(StopRequested):
        s.run_rollout(2)
    pending = s.pending()
    assert pending is not None and pending.rollout_id == 2 and pending.data.k == 2
    assert pending.staleness == (1 if schedule is OverlappedSchedule else 0)
