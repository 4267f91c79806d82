"""The schedules without Ray (``rl_plugin.loop.schedule``): each runs a rollout's phases in its
order through the ``RolloutLoop`` pieces only, and owns the rollout generated ahead
(``PendingRollout``): what a checkpoint saves and a resume hands back."""

from __future__ import annotations

import inspect
from dataclasses import FrozenInstanceError, replace
from typing import Any, Dict, List, Optional

import pytest

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.errors import LoopError, StopRequested
from rl_plugin.loop.fully_async_schedule import FullyAsyncSchedule
from rl_plugin.loop.overlapped_schedule import OverlappedSchedule
from rl_plugin.loop.rollout_pieces import RolloutPieces
from rl_plugin.loop.schedule import RolloutLoop, Schedule
from rl_plugin.loop.sync_schedule import SyncSchedule


class _Cfg:
    """What a schedule reads of ``LoopConfig``: the rollout count and when a train call publishes
    (here: when a later generate loads it; no eval)."""

    def __init__(self, num_rollout: int, interval: int = 1, eval_at=()):
        self.num_rollout, self.update_weights_interval, self.eval_at = num_rollout, interval, set(eval_at)

    def eval_due(self, k: int) -> bool:
        return k in self.eval_at

    def sync_due(self, k: int, ahead: int) -> bool:
        return k + 1 + ahead < self.num_rollout


class _Data:
    """Stands in for a ``RolloutData``: the schedules read only its ``stats``."""

    def __init__(self, k: int):
        self.k, self.stats = k, {}


class FakeLoop:
    """A ``RolloutLoop`` that records the calls a schedule makes, in order."""

    def __init__(self, restart_while_generating: Optional[int] = None, fail_wait: Optional[int] = None):
        self.calls: List[tuple] = []
        self.restarts = 0
        self.restart_while_generating, self.fail_wait = restart_while_generating, fail_wait
        self.finished: Dict[int, Dict[str, Any]] = {}

    def generate(self, k):
        self.calls.append(("generate", k))
        return _Data(k)

    def submit_generate(self, k):
        self.calls.append(("submit_generate", k))
        return k

    def wait_generate(self, k, in_flight):
        self.calls.append(("wait_generate", k))
        assert in_flight == k
        if k == self.fail_wait:
            raise LoopError("the manager died too often")
        if k == self.restart_while_generating:
            self.restarts += 1  # a fresh manager, synced with the trainer's current weights
        return _Data(k)

    def take(self, k):
        self.calls.append(("take", k))
        return _Data(k)

    def manager_restarts(self):
        return self.restarts

    def local_source(self):
        return None

    def train_rollout(self, data, sync=False, batch=None):
        self.calls.append(("train", data.k, sync))
        return [{"samples": 1}]

    def eval_nll(self, batch):
        return 0.0, 0.0

    def sync_timings(self):
        return {}

    def log_steps(self, k, data, reports, timings, t0, staleness):
        self.calls.append(("log_steps", k, staleness))

    def finish_rollout(self, k, data, reports, timings, t0, staleness=None, evaluate=None):
        self.calls.append(("finish", k, staleness))
        self.finished[k] = timings


def _run(schedule: Schedule, num_rollout: int, start: int = 0) -> None:
    for k in range(start, num_rollout):
        schedule.run_rollout(k)


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


def test_sync_generates_then_trains_each_rollout():
    loop = FakeLoop()
    schedule = SyncSchedule(loop, _Cfg(3))
    _run(schedule, 3)
    assert loop.calls == [
        ("generate", 0), ("train", 0, True), ("finish", 0, None),
        ("generate", 1), ("train", 1, True), ("finish", 1, None),
        ("generate", 2), ("train", 2, False), ("finish", 2, None),
    ]  # fmt: skip
    assert schedule.pending() is None
    assert set(loop.finished[0]) == {"time/rollout_call", "time/train"}


def test_overlapped_generates_one_ahead_and_owns_it():
    loop = FakeLoop()
    schedule = OverlappedSchedule(loop, _Cfg(3))
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
    _run(schedule, 3, start=1)
    assert loop.calls == [
        ("submit_generate", 2), ("train", 1, False), ("wait_generate", 2), ("finish", 1, 1),
        ("train", 2, False), ("finish", 2, 1),
    ]  # fmt: skip
    assert schedule.pending() is None


def test_overlapped_rollout_sampled_by_a_restarted_manager_has_no_lag():
    loop = FakeLoop(restart_while_generating=1)
    schedule = OverlappedSchedule(loop, _Cfg(3))
    schedule.run_rollout(0)
    assert schedule.pending().staleness == 0
    schedule.run_rollout(1)
    assert loop.calls[-1] == ("finish", 1, 0)


def test_overlapped_failure_ahead_keeps_the_steps_logged():
    loop = FakeLoop(fail_wait=1)
    schedule = OverlappedSchedule(loop, _Cfg(3))
    with pytest.raises(LoopError):
        schedule.run_rollout(0)
    assert loop.calls[-1] == ("log_steps", 0, 0)


@pytest.mark.parametrize("schedule_cls", [SyncSchedule, OverlappedSchedule])
def test_resumed_pending_is_trained_as_it_was(schedule_cls):
    """A checkpoint's rollout generated ahead is trained first, with its staleness, not generated again."""
    loop = FakeLoop()
    schedule = schedule_cls(loop, _Cfg(3))
    stored = _Data(1)
    schedule.resume(PendingRollout(1, stored, 1))
    schedule.run_rollout(1)
    if schedule_cls is SyncSchedule:
        assert loop.calls == [("train", 1, True), ("finish", 1, None)]
    else:
        assert loop.calls == [("submit_generate", 2), ("train", 1, False), ("wait_generate", 2), ("finish", 1, 1)]


def test_pending_of_another_rollout_is_refused():
    schedule = SyncSchedule(FakeLoop(), _Cfg(3))
    schedule.resume(PendingRollout(2, _Data(2), 1))
    with pytest.raises(LoopError, match="generated ahead is rollout 2, the loop is at rollout 1"):
        schedule.run_rollout(1)


def test_pending_rollout_is_frozen():
    pending = PendingRollout(1, _Data(1), 1)
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
    s = schedule(loop, _Cfg(5))
    s.run_rollout(0)
    s.run_rollout(1)
    with pytest.raises(StopRequested):
        s.run_rollout(2)
    pending = s.pending()
    assert pending is not None and pending.rollout_id == 2 and pending.data.k == 2
    assert pending.staleness == (1 if schedule is OverlappedSchedule else 0)


def test_fully_async_takes_trains_and_publishes_every_interval_and_before_an_eval():
    loop = FakeLoop()
    schedule = FullyAsyncSchedule(loop, _Cfg(5, interval=2, eval_at={2}))
    _run(schedule, 5)
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
    schedule = FullyAsyncSchedule(loop, _Cfg(4))
    schedule.resume(PendingRollout(2, _Data(2), 0))
    _run(schedule, 4, start=2)
    assert [c[:2] for c in loop.calls if c[0] in ("take", "train")] == [("train", 2), ("take", 3), ("train", 3)]
