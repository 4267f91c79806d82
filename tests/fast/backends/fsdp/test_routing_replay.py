"""Routing replay on the FSDP backend (``rl_plugin.backends.fsdp.routing_replay.RoutingPass``) on
a real tiny Qwen3-MoE (transformers' routers): a record pass of a thd micro-batch run as the padded
grid gives the routing in packed order (each sample's own, as its forward alone routes it); its
replay reproduces the free forward bitwise, in the grid and in bshd rows, counting the agreement on
the routed response tokens only; other experts replayed change the logits and the count; and the
refusals (an unknown action, a dense model, a micro-batch without routed experts)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_plugin.backends.fsdp.packing import model_inputs, thd_as_padded_grid
from rl_plugin.backends.fsdp.routing_replay import RoutingPass
from rl_plugin.loss import StepBatch
from rl_plugin.loss.backend_api import MicroBatchInputs
from rl_plugin.models.tiny import tiny_config
from rl_plugin.models.tiny_moe import MOE_SIZES
from rl_plugin.routing.hf import RoutingRecorder
from rl_plugin.routing.layout import local_routed_experts

CPU = torch.device("cpu")
# two samples: 6 tokens (prompt 3, response 3) and 4 (prompt 2, response 2); the routed response
# tokens (every response token but the sample's last): packed positions 3, 4 and 8
LENGTHS, RESPONSES, ROUTED = [6, 4], [3, 2], [3, 4, 8]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", **MOE_SIZES)).eval()


def _batch(model):
    g = torch.Generator().manual_seed(1)
    return StepBatch(
        tokens=torch.randint(0, model.config.vocab_size, (sum(LENGTHS),), generator=g),
        total_lengths=torch.tensor(LENGTHS),
        response_lengths=torch.tensor(RESPONSES),
        loss_mask=torch.ones(sum(RESPONSES)),
        advantages=torch.zeros(sum(RESPONSES)),
        group_ids=torch.tensor([0, 0]),
    )


def _forward(model, mb, attn):
    kwargs, _ = model_inputs(mb, attn, CPU)
    with torch.no_grad():
        return model(**kwargs).logits


def _sets(experts):
    return experts.sort(dim=-1).values


def test_record_then_replay_is_the_free_forward_in_the_grid_and_in_bshd(model):
    attn = model.config._attn_implementation
    batch = _batch(model)
    mb = MicroBatchInputs.build(batch)
    assert thd_as_padded_grid(mb.layout, attn)  # the grid path: its gather / valid cells
    free = _forward(model, mb, attn)
    record = RoutingPass("record", attn)
    with record.context(model, mb):
        _forward(model, mb, attn)
    recorded = mb.recorded_routing
    assert recorded.shape == (sum(LENGTHS), 2, 2)  # packed tokens x MoE layers x top-k, padding cells dropped
    alone = []  # each sample's own forward, its routing per position
    for sample in batch.tokens.split(LENGTHS):
        with torch.no_grad(), RoutingRecorder(model) as rec:
            model(input_ids=sample.view(1, -1))
        alone.append(rec.per_row(1)[0])
    assert torch.equal(_sets(recorded.long()), _sets(torch.cat(alone).long()))

    mb.routed_experts = recorded.to(torch.int16)
    replay = RoutingPass("replay", attn)
    with replay.context(model, mb):
        again = _forward(model, mb, attn)
    assert torch.equal(again, free)
    assert (replay.agreement.agree, replay.agreement.total) == (2 * len(ROUTED), 2 * len(ROUTED))

    rows = MicroBatchInputs.build(batch, qkv_format="bshd")  # [S, max_len] rows with padding
    free_rows = _forward(model, rows, attn)
    rows.routed_experts = local_routed_experts(rows.layout.input_index, recorded.to(torch.int16))
    replay_rows = RoutingPass("replay", attn)
    with replay_rows.context(model, rows):
        again_rows = _forward(model, rows, attn)
    real = (rows.layout.input_index >= 0).view(len(LENGTHS), -1)
    assert torch.equal(again_rows[real], free_rows[real])
    assert (replay_rows.agreement.agree, replay_rows.agreement.total) == (2 * len(ROUTED), 2 * len(ROUTED))


def test_other_experts_replayed_change_the_logits_and_the_agreement(model):
    attn = model.config._attn_implementation
    mb = MicroBatchInputs.build(_batch(model))
    free = _forward(model, mb, attn)
    with RoutingPass("record", attn).context(model, mb):
        _forward(model, mb, attn)
    routed = mb.recorded_routing.to(torch.int16).clone()
    token = ROUTED[0]
    own = set(routed[token, 0].tolist())
    routed[token, 0] = torch.tensor(sorted(set(range(4)) - own), dtype=torch.int16)  # the other two experts
    mb.routed_experts = routed
    replay = RoutingPass("replay", attn)
    with replay.context(model, mb):
        moved = _forward(model, mb, attn)
    assert not torch.equal(moved, free)
    assert replay.agreement.total == 2 * len(ROUTED) and replay.agreement.agree <= 2 * len(ROUTED) - 1


def test_refusals(model):
    attn = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"^routing pass: unknown action 'route'$"):
        RoutingPass("route", attn)
    mb = MicroBatchInputs.build(_batch(model))
    dense = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    with pytest.raises(
        ValueError, match=r"^routing replay: the FSDP model has no mixture-of-experts router \(a dense model\)$"
    ):
        with RoutingPass("record", attn).context(dense, mb):
            pass
    with pytest.raises(
        ValueError,
        match=r"^routing replay: the micro-batch carries no routed experts \(the rollout recorded none\)$",
    ):
        with RoutingPass("replay", attn).context(model, mb):
            pass
