"""The SFT schedule (``rl_plugin.loop.sft_schedule``): batch k from the loop's local SFT source,
its optimizer steps on the NLL batch (the assistant-span loss mask, no advantage) without a weight
sync, then the rollout's rows / checkpoint with the schedule's own eval (the held-out NLL as
``eval/nll``, ``eval/ppl``, ``eval/tokens``); nothing generated ahead, and a checkpoint holding an
RL rollout generated ahead refused with its fix."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.sft_schedule import SftSchedule
from rl_plugin.rollout.sample import RolloutData
from tests.support.schedules import FakeData, FakeLoop, ScheduleCfg, run_rollouts


def _conversations(k: int) -> RolloutData:
    """Two conversations (5 and 4 tokens; assistant spans 2 and 3 tokens); ``k`` marks the tokens."""
    loss_mask = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int64)  # a masked turn inside the first span
    data = RolloutData(
        tokens=torch.full((9,), k),
        total_lengths=torch.tensor([5, 4]),
        response_lengths=torch.tensor([2, 3]),
        rollout_log_probs=torch.zeros(5),
        rewards=torch.zeros(2),
        group_ids=torch.arange(2),
        num_groups=2,
        loss_mask=loss_mask,
    )
    data.k = k  # what FakeLoop's records name
    return data


class Source:
    """The SFT source's calls the schedule makes: ``rollout(k)`` (batch k) and ``eval_data()``."""

    def __init__(self):
        self.asked = []

    def rollout(self, k):
        self.asked.append(k)
        return _conversations(k)

    def eval_data(self):
        return _conversations(99)


class SftLoop(FakeLoop):
    """``FakeLoop`` with the local source, and the step batches and evals it was handed."""

    def __init__(self):
        super().__init__()
        self.source, self.batches, self.evaluates = Source(), [], {}

    def local_source(self):
        return self.source

    def train_rollout(self, data, sync=False, batch=None):
        self.batches.append(batch)
        return super().train_rollout(data, sync, batch)

    def eval_nll(self, batch):
        self.batches.append(batch)
        return 6.0, 4.0

    def finish_rollout(self, k, data, reports, timings, t0, staleness=None, evaluate=None):
        self.evaluates[k] = evaluate
        super().finish_rollout(k, data, reports, timings, t0, staleness, evaluate)


def test_each_batch_is_trained_on_its_nll_batch_without_a_sync_then_finished():
    loop = SftLoop()
    schedule = SftSchedule(loop, ScheduleCfg(3))
    run_rollouts(schedule, 3, start=1)  # a resumed run starts at its checkpoint's batch
    assert loop.source.asked == [1, 2]
    assert loop.calls == [("train", 1, False), ("finish", 1, None), ("train", 2, False), ("finish", 2, None)]
    batch = loop.batches[0]
    assert batch.loss_mask.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0] and batch.advantages.tolist() == [0.0] * 5
    assert batch.group_ids.tolist() == [0, 1] and torch.equal(batch.tokens, torch.full((9,), 1))
    assert set(loop.finished[1]) == {"time/sft_batch", "time/train"}
    assert schedule.pending() is None
    assert loop.evaluates[2] == schedule.evaluate  # the eval after a batch is the schedule's own


def test_the_eval_is_the_held_out_token_mean_nll():
    loop = SftLoop()
    schedule = SftSchedule(loop, ScheduleCfg(3))
    assert schedule.evaluate(2) == {"eval/nll": 1.5, "eval/ppl": math.exp(1.5), "eval/tokens": 4.0}
    (held_out,) = loop.batches
    assert torch.equal(held_out.tokens, torch.full((9,), 99))  # the source's eval data, as an NLL batch


def test_a_checkpoint_with_a_rollout_generated_ahead_is_refused():
    schedule = SftSchedule(SftLoop(), ScheduleCfg(3))
    schedule.resume(None)  # a complete rollout's checkpoint: nothing to hand back
    with pytest.raises(ValueError) as err:
        schedule.resume(PendingRollout(4, FakeData(4), staleness=1))
    assert str(err.value) == (
        "the checkpoint holds rollout 4 generated ahead by an overlapped RL run; --loss-type sft_loss trains on "
        "data, not rollouts. Fix: --load a checkpoint written after a complete rollout, or start the SFT run from "
        "its --hf-checkpoint"
    )
