"""The rollout's pieces (``rl_plugin.loop.rollout_pieces``) that need no actor: each rank's plan
of optimizer steps (its data-parallel rank's share; the TP / PP ranks of one DP rank share it),
the schedule chosen by the run's mode, and the refusal of a train call cut before its last
step. (The pieces over real actors: ``tests/fast/e2e``.)"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.errors import StopRequested
from rl_plugin.loop.advantages import rollout_batch
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.fully_async_schedule import FullyAsyncSchedule
from rl_plugin.loop.overlapped_schedule import OverlappedSchedule
from rl_plugin.loop.resume import Progress
from rl_plugin.loop.rollout_pieces import RolloutPieces, _check_complete
from rl_plugin.loop.sync_schedule import SyncSchedule
from rl_plugin.ray.train_group import TrainGroup
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.step_plan import plan_global_batch_steps
from rl_plugin.weight_sync import WeightLedger


def _group(dp_ranks):
    """A ``TrainGroup`` as its ranks' ``init`` left it (world size, DP size, each rank's DP rank),
    without its actors: ``_plans`` reads only that layout."""
    group = TrainGroup.__new__(TrainGroup)
    group.world_size, group.dp_size = len(dp_ranks), max(dp_ranks) + 1
    group.info = [{"dp_rank": d, "ip": "127.0.0.1"} for d in dp_ranks]
    return group


def _pieces(group, *flags):
    cfg = LoopConfig.from_args(parse_train_flags(list(flags)))
    return RolloutPieces(cfg, group, None, WeightLedger(cfg.sync), Progress(), lambda: "hint")


def _rollout(num_groups=2, n=4):
    g = torch.Generator().manual_seed(0)
    s = num_groups * n
    rl = torch.randint(1, 4, (s,), generator=g)
    return RolloutData(
        tokens=torch.randint(0, 16, (int((rl + 2).sum()),), generator=g),
        total_lengths=rl + 2,
        response_lengths=rl,
        rollout_log_probs=-torch.rand(int(rl.sum()), generator=g),
        rewards=torch.rand(s, generator=g),
        group_ids=torch.arange(num_groups).repeat_interleave(n),
        num_groups=num_groups,
    )


def test_each_rank_plans_its_dp_ranks_share():
    """TP 2 x DP 2: ranks 0, 1 are DP rank 0, ranks 2, 3 DP rank 1; --global-batch-size 4 of 8 samples."""
    data = _rollout()
    pieces = _pieces(_group([0, 0, 1, 1]), "--global-batch-size", "4", "--n-samples-per-prompt", "4")
    plans = pieces._plans(rollout_batch(data, "grpo"), data.num_groups)
    want = plan_global_batch_steps(rollout_batch(data, "grpo"), global_batch_size=4, dp_size=2)
    assert len(plans) == 4 and plans[0] is plans[1] and plans[2] is plans[3]
    for rank, dp in enumerate([0, 0, 1, 1]):
        assert plans[rank].step_bounds == want[dp].step_bounds == [(0, 2), (2, 4)]
        assert torch.equal(plans[rank].batch.tokens, want[dp].batch.tokens)
        assert plans[rank].batch.group_ids.tolist() == want[dp].batch.group_ids.tolist()
    (whole,) = _pieces(_group([0]))._plans(rollout_batch(data, "grpo"), data.num_groups)
    assert whole.step_bounds == [(0, 8)]  # no --global-batch-size: one step of the whole rollout


def test_the_mode_picks_the_schedule():
    assert type(_pieces(_group([0])).schedule) is SyncSchedule
    assert type(_pieces(_group([0]), "--max-weight-staleness", "1").schedule) is OverlappedSchedule
    fully = _pieces(_group([0]), "--fully-async", "--max-weight-staleness", "1")
    assert type(fully.schedule) is FullyAsyncSchedule


def test_a_train_call_cut_before_its_last_step_is_a_stop():
    data = _rollout()
    (plan,) = plan_global_batch_steps(rollout_batch(data, "grpo"), global_batch_size=4, dp_size=1)
    _check_complete([{"loss": 0.1}, {"loss": 0.2}], plan)  # 2 of 2 steps: complete
    with pytest.raises(StopRequested) as err:
        _check_complete([{"loss": 0.1}], plan)
    assert str(err.value) == "the train call stopped before its optimizer step 2 of 2"
    assert err.value.steps_done == 1 and not err.value.stuck
