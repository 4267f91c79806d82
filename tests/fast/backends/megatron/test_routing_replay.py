"""Routing replay on megatron-core (``rl_plugin.backends.megatron.routing_replay``), on real
megatron-core ``TopKRouter`` modules and their ``RouterReplay`` objects (no model around them,
no process group: the routers' top-k call is made directly, with the scores a forward would give):
the replay routes to the targets (an ``UNROUTED`` row by the router's own top-k) and counts the
agreement, the record stacks the layers' own top-k, both leave the routers as they found them,
and the refusals name what is wrong. (Token order: ``tests/fast/backends/megatron/test_router_order.py``;
the passes in a real forward: ``tests/fast/routing/test_replay_padding.py``.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from rl_plugin.routing.layout import UNROUTED

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")


def _routers(num=2, replay=True, **config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=num,
        hidden_size=8,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_enable_routing_replay=replay,
        use_cpu_initialization=True,
        add_bias_linear=False,
        **config,
    )
    groups = ProcessGroupCollection(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    return torch.nn.ModuleList([TopKRouter(cfg, pg_collection=groups) for _ in range(num)])


def _own_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, topk, dim=-1)


SCORES = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.8, 0.2, 0.7, 0.0], [0.4, 0.6, 0.1, 0.3]])  # own: {3,1} {0,2} {1,0}


def _route(model, scores=SCORES):
    """Each router's top-k call on ``scores``, as its forward makes it."""
    from rl_plugin.backends.megatron.routing_replay import routers_of

    return [r.router_replay.get_replay_topk(scores, 2, default_compute_topk=_own_topk) for r in routers_of(model)]


def test_replay_routes_to_the_targets_and_the_router_itself_where_unrouted():
    from rl_plugin.backends.megatron.routing_replay import replaying, replays_of

    model = _routers()
    routed = torch.tensor(
        [
            [[3, 1], [2, 0]],  # token 0: layer 0 its own set, layer 1 another
            [[UNROUTED, UNROUTED], [1, 3]],  # token 1: layer 0 unrouted: the router's own top-k
            [[0, 1], [1, 0]],  # token 2: its own set both times
        ],
        dtype=torch.int16,
    )  # [N, layers, k]
    agree = []
    with replaying(model, routed, agree):
        (probs0, top0), (probs1, top1) = _route(model)
    assert top0.tolist() == [[3, 1], [0, 2], [0, 1]] and top1.tolist() == [[2, 0], [1, 3], [1, 0]]
    assert torch.equal(probs0, SCORES.gather(1, top0)) and torch.equal(probs1, SCORES.gather(1, top1))
    assert [a.tolist() for a in agree] == [[True, True, True], [False, False, True]]
    for replay in replays_of(model):  # left as found: no action, no indices, megatron-core's method
        assert replay.router_replay_action is None and replay.target_topk_idx is None
        assert "get_replay_topk" not in vars(replay)
    _, free = _route(model)[0]
    assert free.tolist() == [[3, 1], [0, 2], [1, 0]]
    with pytest.raises(
        ValueError,
        match=r"^routing replay: the rollout carries 3 MoE layers of routed experts, the Megatron model has 2$",
    ):
        with replaying(model, torch.zeros(3, 3, 2, dtype=torch.int16)):
            pass


def test_record_stacks_each_layers_own_topk():
    from rl_plugin.backends.megatron.routing_replay import recording, replays_of

    model = _routers()
    out = []
    with recording(model, out):
        _route(model)
    (recorded,) = out
    assert recorded.shape == (3, 2, 2)
    assert recorded[:, 0].tolist() == recorded[:, 1].tolist() == [[3, 1], [0, 2], [1, 0]]
    assert all(r.router_replay_action is None and r.recorded_topk_idx is None for r in replays_of(model))


def test_refusals_name_the_model_or_the_flag():
    from rl_plugin.backends.megatron.routing_replay import RoutingPass, replays_of, routers_of

    assert routers_of(torch.nn.Linear(2, 2)) == []
    with pytest.raises(ValueError, match=r"^routing replay: the Megatron model has no MoE router \(a dense model\)$"):
        replays_of(torch.nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"^routing replay: the Megatron model was built without moe_enable_routing_replay$"
    ):
        replays_of(_routers(replay=False))
    with pytest.raises(ValueError, match=r"activation recompute re-routes in the backward; run without recompute$"):
        replays_of(_routers(recompute_granularity="selective"))
    with pytest.raises(ValueError, match=r"^routing pass: unknown action 'route'$"):
        RoutingPass("route")


def _micro_batch():
    """Two samples: 3 tokens (prompt 1, response 2) and 2 (prompt 1, response 1); the one routed
    response token (a response token that is not its sample's last): packed position 1."""
    from rl_plugin.loss import StepBatch
    from rl_plugin.loss.backend_api import MicroBatchInputs

    batch = StepBatch(
        tokens=torch.arange(5),
        total_lengths=torch.tensor([3, 2]),
        response_lengths=torch.tensor([2, 1]),
        loss_mask=torch.ones(3),
        advantages=torch.zeros(3),
        group_ids=torch.tensor([0, 0]),
    )
    return MicroBatchInputs.build(batch)


def test_a_pass_over_a_micro_batch_counts_the_routed_response_tokens_only():
    from rl_plugin.backends.megatron.routing_replay import RoutingPass

    model = _routers()
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.9]] * 5)  # every token's own top-k: {3, 1}
    mb = _micro_batch()
    record = RoutingPass("record")
    with record.context(model, mb, "thd"):
        _route(model, scores)
    assert mb.recorded_routing.shape == (5, 2, 2) and mb.recorded_routing[:, 0].tolist() == [[3, 1]] * 5
    mb.routed_experts = torch.tensor([[[0, 2], [1, 3]]] * 5, dtype=torch.int16)  # layer 0 other, layer 1 the same set
    replay = RoutingPass("replay")
    with replay.context(model, mb, "thd"):
        (_, top0), (_, top1) = _route(model, scores)
    assert top0.tolist() == [[0, 2]] * 5 and top1.tolist() == [[1, 3]] * 5
    assert (replay.agreement.agree, replay.agreement.total) == (1, 2)  # token 1 in 2 layers; layer 1 agrees
    with pytest.raises(ValueError, match=r"^routing replay: the micro-batch carries no routed experts"):
        with RoutingPass("replay").context(model, _micro_batch(), "thd"):
            pass
    with pytest.raises(
        ValueError,
        match=r"under --sequence-parallel each TP rank routes only its share .* Fix: drop --sequence-parallel$",
    ):
        with RoutingPass("record", tp_rank=0, tp_size=2, sequence_parallel=True).context(model, _micro_batch(), "thd"):
            pass
