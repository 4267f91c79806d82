"""The SFT schedule (``rl_plugin.loop.sft_schedule``): batch k from the SFT source, its optimizer
steps without a weight sync, then the rollout's rows / checkpoint / eval; nothing generated ahead,
and a checkpoint holding an RL rollout generated ahead refused with its fix."""

from __future__ import annotations

import pytest

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.sft_schedule import SftSchedule
from tests.support.schedules import FakeData, FakeLoop, ScheduleCfg, run_rollouts


class Source:
    """The SFT source's one call the schedule makes: ``rollout(k)``, batch k."""

    def __init__(self):
        self.asked = []

    def rollout(self, k):
        self.asked.append(k)
        return FakeData(k)


def test_each_batch_is_trained_without_a_sync_then_finished():
    loop, source = FakeLoop(), Source()
    schedule = SftSchedule(loop, ScheduleCfg(3, eval_at={2}), source)
    run_rollouts(schedule, 3, start=1)  # a resumed run starts at its checkpoint's batch
    assert source.asked == [1, 2]
    assert loop.calls == [("train", 1, False), ("finish", 1, None), ("train", 2, False), ("finish", 2, None)]
    assert set(loop.finished[1]) == {"time/sft_batch", "time/train"}
    assert all(t >= 0 for t in loop.finished[2].values())
    assert schedule.pending() is None


def test_a_checkpoint_with_a_rollout_generated_ahead_is_refused():
    schedule = SftSchedule(FakeLoop(), ScheduleCfg(3), Source())
    schedule.resume(None)  # a complete rollout's checkpoint: nothing to hand back
    with pytest.raises(ValueError) as err:
        schedule.resume(PendingRollout(4, FakeData(4), staleness=1))
    assert str(err.value) == (
        "the checkpoint holds rollout 4 generated ahead by an overlapped RL run; --loss-type sft_loss trains on "
        "data, not rollouts. Fix: --load a checkpoint written after a complete rollout, or start the SFT run from "
        "its --hf-checkpoint"
    )
