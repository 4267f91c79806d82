"""The rollout manager (``rl_plugin.rollout.manager.RolloutManager``) on the real embedded model and
``hf`` engine, in this process: a rollout's shape (contiguous groups, one reward per sample), its
data position equal to ``state_dict()``, a resumed manager generating the same next rollout, a
weight sync through ``update_weights`` changing what the engine samples, and the refusal of the
routing-flip test hook without an engine in this process."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.weight_sync import SyncRequest, WeightPublisher, node_id, weights_fingerprint

B, N = 3, 2  # prompts per rollout, samples per prompt


def _args(tmp_path, *extra):
    args = parse_train_flags(
        ["--n-samples-per-prompt", str(N), "--rollout-batch-size", str(B), "--output-dir", str(tmp_path / "out")]
        + ["--rollout-max-response-len", "8", "--eval-prompt-data", ""]
        + list(extra)
    )
    prepare_embedded(args)
    return args


def _manager(args, **kw):
    return RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args, **kw)


@pytest.fixture
def args(tmp_path):
    torch.manual_seed(0)
    return _args(tmp_path)


def test_a_rollout_is_contiguous_groups_and_its_position(args):
    m = _manager(args)
    data = m.generate(0)
    assert data.num_groups == B and data.group_ids.tolist() == [g for g in range(B) for _ in range(N)]
    assert data.rewards.shape == (B * N,) and bool(((data.rewards >= 0) & (data.rewards <= 1)).all())
    assert int(data.total_lengths.sum()) == data.tokens.numel()
    assert int(data.response_lengths.sum()) == data.rollout_log_probs.numel() == data.loss_mask.numel()
    assert bool((data.response_lengths <= 8).all()) and bool((data.rollout_log_probs <= 0).all())
    assert data.weight_load is None  # no handle: nothing loaded
    assert data.dataset_state == m.state_dict() and m.state_dict()["train_dataset"]["offset"] == B


def test_a_resumed_manager_generates_the_same_next_rollout(args):
    m = _manager(args)
    m.generate(0)
    state = m.state_dict()
    want = m.generate(1)
    other = _manager(args)
    other.load_state_dict(state)
    got = other.generate(1)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.rewards, want.rewards)
    assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)


def test_update_weights_loads_into_the_engine(args):
    m = _manager(args)
    engine = m.fleet.engine
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in engine.weights().items()}
    before = m.generate(0)
    m.load_state_dict({"train_dataset": {"epoch": 0, "offset": 0}})
    pub = WeightPublisher("shared_memory")
    try:
        out = m.update_weights(pub.publish(new, SyncRequest(buffer_bytes=1 << 20, fingerprint=True)), version=1)
    finally:
        pub.close()
    assert out["fingerprints"] == [weights_fingerprint(new)] == [weights_fingerprint(engine.weights())]
    assert m.fleet.version == 1 and m.engine_node_ids() == [node_id()]
    after = m.generate(0)  # same prompts and seed, new weights: other log-probs
    assert not torch.equal(after.rollout_log_probs[:4], before.rollout_log_probs[:4])


def test_the_routing_flip_hook_needs_the_engine_in_this_process(tmp_path):
    args = _args(tmp_path, "--debug-engine-routing-flip", "1")
    with pytest.raises(ValueError) as info:
        _manager(args, engines=[object()])
    assert str(info.value) == (
        "--debug-engine-routing-flip hooks the hf engine of the rollout manager's process; with engine actors "
        "(--rollout-num-gpus) there is none. Fix: drop --rollout-num-gpus or the hook"
    )
