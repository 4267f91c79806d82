"""The fully-async source (``rl_plugin.rollout.fully_async.source``) on the real embedded model and
``hf`` engine (the rollout manager in this process, ``--fully-async``): before the first rollout
no worker runs and the position is the generation source's; ``rollout(k)`` starts the worker and
takes ``--rollout-batch-size`` groups with their ``async/*`` metrics (staleness within the bound,
one version here: 0); the eval before the first rollout is the generation source's; ``stop`` ends
the worker and a take from a stopped worker names it."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout.fully_async.source import FullyAsyncSource, take_groups
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.rollout.source import FULLY_ASYNC

B, N = 2, 2


@pytest.fixture
def manager(tmp_path):
    args = parse_train_flags(
        ["--n-samples-per-prompt", str(N), "--rollout-batch-size", str(B), "--output-dir", str(tmp_path / "out")]
        + ["--fully-async", "--max-weight-staleness", "1", "--rollout-max-response-len", "8"]
    )
    prepare_embedded(args)
    torch.manual_seed(0)
    m = RolloutManager(
        RolloutConfig.from_args(args),
        args.hf_checkpoint,
        args.prompt_data,
        args.eval_prompt_data,
        args=args,
        source=FULLY_ASYNC,
        async_settings=LoopConfig.from_args(args).async_settings,
    )
    yield m
    m.stop()


def test_a_rollout_starts_the_worker_and_takes_whole_groups(manager):
    src = manager.source
    assert isinstance(src, FullyAsyncSource) and src.producer is None
    assert src.state_dict() == {"train_dataset": {"epoch": 0, "offset": 0}}  # no worker: the generation's
    out = src.evaluate(0)  # no worker yet: the generation source's eval
    assert set(out) == {"eval/reward_mean", "eval/response_len_mean"}
    data = manager.generate(0)
    assert src.producer is not None and src.producer.gate.version == 0  # a fresh manager: version k
    assert data.num_groups == B and data.group_ids.tolist() == [0, 0, 1, 1]
    assert data.stats["async/staleness_max"] == 0.0 and data.stats["async/staleness_mean"] == 0.0
    assert data.stats["async/trainer_wait_s"] >= 0 and data.weight_load is None
    for key in ("async/partial_frac", "async/inflight", "async/buffer_groups", "async/dropped_stale"):
        assert key in data.stats
    state = data.dataset_state
    assert state["train_dataset"]["offset"] >= B  # the worker has taken at least this rollout's prompts
    assert set(state) <= {"train_dataset", "async_requeue"}


def test_a_take_from_a_stopped_worker_names_it(manager):
    manager.generate(0)
    p = manager.source.producer
    manager.stop()
    while len(p.buffer):
        p.buffer.get(0, timeout=1)
    with pytest.raises(RuntimeError, match="^the fully-async worker stopped$"):
        take_groups(p, 1, 0)
