"""Recording and replaying a Hugging Face MoE model's routing (``rl_plugin.routing.hf``) on a real
tiny Qwen3-MoE (transformers' own router modules): the routers and their shape, the recorder's
``[B, S, layers, k]``, a replay of the recorded (or unrouted) experts giving the free forward's
logits bitwise, a replay of other experts changing them and reporting the disagreement, the flip
hook's share, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_plugin.models.tiny import tiny_config
from rl_plugin.models.tiny_moe import MOE_SIZES
from rl_plugin.routing.hf import (
    RoutingRecorder,
    hf_routers,
    install_routing_flip,
    replay_routing,
    router_weights,
    routing_shape,
    same_sets,
)
from rl_plugin.routing.layout import UNROUTED
from tests.support.tolerance import FP32_MODEL

IDS = torch.tensor([[5, 9, 17, 3, 44, 2], [7, 7, 1, 90, 12, 6]])


def _model(family="qwen3_moe", **kw):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, **{**MOE_SIZES, **kw})).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def test_routers_and_shape(model):
    assert len(hf_routers(model)) == 2 and routing_shape(model) == (2, 2)
    dense = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    assert hf_routers(dense) == []
    with pytest.raises(ValueError, match="routing replay: Qwen2ForCausalLM has no mixture-of-experts router"):
        routing_shape(dense)


def test_record_then_replay_is_the_free_forward_bitwise(model):
    with torch.no_grad(), RoutingRecorder(model) as rec:
        free = model(input_ids=IDS).logits
    routed = rec.per_row(2)
    assert routed.shape == (2, 6, 2, 2) and routed.dtype == torch.int16
    targets = [routed[:, :, layer].reshape(-1, 2) for layer in range(2)]
    with torch.no_grad(), replay_routing(hf_routers(model), targets) as agree:
        again = model(input_ids=IDS).logits
    assert torch.equal(again, free) and all(bool(a.all()) for a in agree)
    unrouted = [torch.full((12, 2), UNROUTED, dtype=torch.int16)] * 2  # the router's own choice
    with torch.no_grad(), replay_routing(hf_routers(model), unrouted):
        assert torch.equal(model(input_ids=IDS).logits, free)


def test_replaying_other_experts_changes_the_output_and_is_reported(model):
    with torch.no_grad(), RoutingRecorder(model) as rec:
        free = model(input_ids=IDS).logits
    routed = rec.per_row(2)
    targets = [routed[:, :, layer].reshape(-1, 2).clone() for layer in range(2)]
    other = torch.tensor([e for e in range(4) if e not in targets[0][0].tolist()])
    targets[0][0] = other  # token 0 of layer 0 to the two experts its router did not choose
    with torch.no_grad(), replay_routing(hf_routers(model), targets) as agree:
        replayed = model(input_ids=IDS).logits
    assert agree[0].tolist() == [False] + [True] * 11 and bool(agree[1].all())
    change = (replayed - free).abs().amax(dim=-1)  # [rows, seq]
    assert float(change[0, 0]) > 1e-3  # the replayed experts computed that token
    # the other row sees none of it (its own tokens, same experts): only the experts' batched GEMMs
    # over a different set of rows may round differently
    assert float(change[1].max()) <= FP32_MODEL * float(free[1].abs().max())


def test_router_weights_are_the_routers_own(model):
    router = hf_routers(model)[0]
    logits = torch.randn(5, 4)
    idx = torch.tensor([[0, 1], [3, 2], [1, 0], [2, 3], [0, 3]])
    w = router_weights(router, logits, idx)
    p = torch.softmax(logits, -1).gather(1, idx)
    assert torch.allclose(w, p / p.sum(-1, keepdim=True), rtol=0, atol=1e-7)  # Qwen3-MoE renormalises
    q2 = hf_routers(_model("qwen2_moe"))[0]  # Qwen2-MoE does not
    assert torch.allclose(router_weights(q2, logits, idx), p, rtol=0, atol=1e-7)
    assert same_sets(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 1]])).tolist() == [True, False]


def test_the_flip_moves_about_its_share_of_tokens():
    flipped = _model()
    install_routing_flip(flipped, 0.5)
    with torch.no_grad(), RoutingRecorder(flipped) as rec:
        flipped(input_ids=torch.arange(64).view(2, 32))
    model = _model()
    with torch.no_grad(), RoutingRecorder(model) as own:
        model(input_ids=torch.arange(64).view(2, 32))
    differ = ~same_sets(rec.per_row(2).view(-1, 2).long(), own.per_row(2).view(-1, 2).long())
    assert 0.25 < float(differ.float().mean()) < 0.75  # about half of the (token, layer) pairs
    with pytest.raises(ValueError, match="needs more experts \\(2\\) than top_k \\(2\\)"):
        install_routing_flip(_model(num_experts=2), 0.5)


def test_replay_refuses_a_wrong_layer_count(model):
    with pytest.raises(ValueError, match="1 layers of routed experts for 2 MoE layers"):
        with replay_routing(hf_routers(model), [torch.zeros(12, 2, dtype=torch.long)]):
            pass
