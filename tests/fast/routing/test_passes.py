"""Which routing each pass runs under routing replay (``rl_plugin.routing.passes``): R3 replays
every pass, R2 records on the actor's forward-only pass and replays after, the reference routes
freely; the recorded pieces assembled into one step tensor; the agreement fraction."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.routing.layout import UNROUTED, AgreementCounter
from rl_plugin.routing.passes import agreement_metrics, assemble_recorded, routing_action

EXPERTS = torch.zeros(4, 2, 2, dtype=torch.int16)


@pytest.mark.parametrize(
    "mode, routed, role, training, action",
    [
        (None, EXPERTS, "actor", True, None),
        ("rollout", EXPERTS, "actor", True, "replay"),
        ("rollout", EXPERTS, "ref", False, "replay"),
        ("old", None, "actor", False, "record"),
        ("old", EXPERTS, "actor", True, "replay"),
        ("old", None, "actor", True, None),  # the training forward IS the old policy's routing
        ("old", EXPERTS, "ref", False, None),  # the reference routes freely
    ],
)
def test_routing_action(mode, routed, role, training, action):
    assert routing_action(mode, routed, role=role, training=training) == action


def test_routing_action_refusals():
    with pytest.raises(ValueError, match="--use-rollout-routing-replay: the rollout carries no routed experts"):
        routing_action("rollout", None, role="actor", training=True)
    with pytest.raises(ValueError, match="unknown routing replay mode 'both'"):
        routing_action("both", EXPERTS, role="actor", training=True)


def test_assemble_recorded_pads_what_no_rank_of_this_process_routed():
    a = (torch.tensor([0, 2]), torch.tensor([[[1, 2]], [[3, 4]]]))
    b = (torch.tensor([4]), torch.tensor([[[5, 6]]]))
    got = assemble_recorded([a, b], 6)
    assert got.dtype == torch.int16 and got.shape == (6, 1, 2)
    assert got[:, 0].tolist() == [[1, 2], [UNROUTED] * 2, [3, 4], [UNROUTED] * 2, [5, 6], [UNROUTED] * 2]


def test_agreement_fraction():
    c = AgreementCounter()
    c.add(torch.tensor([True, True, False]), torch.ones(3, dtype=torch.bool))
    assert agreement_metrics(c, None) == {"routing/topk_agree_frac": 2 / 3}
    assert math.isnan(agreement_metrics(AgreementCounter(), None)["routing/topk_agree_frac"])
