"""The FSDP backend's router losses are megatron-core's (``switch_load_balancing_loss_func``,
``z_loss_func`` of ``transformer/moe/moe_utils.py``) on the same logits, and the MoE flags refuse
what a backend does not run, naming the flag."""

from __future__ import annotations

import pytest
import torch

from tests.support.tolerance import FP32_LOSS_CORE


def test_layer_losses_are_megatron_cores():
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    from rl_plugin.backends.fsdp.router_losses import layer_losses

    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(37, 8, generator=g)  # fp32: the routing scores are fp32 on both
    ours = layer_losses(logits, top_k=2)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    routing = torch.zeros_like(probs).scatter(1, torch.topk(probs, 2, dim=1).indices, 1.0)
    aux = switch_load_balancing_loss_func(probs, routing.sum(0), 37, 2, 8, 1.0)
    assert abs(float(ours["load_balancing_loss"] - aux)) <= FP32_LOSS_CORE * float(aux)
    assert abs(float(ours["z_loss"] - z_loss_func(logits, 1.0))) <= FP32_LOSS_CORE * float(ours["z_loss"])
    # a perfectly balanced router (uniform probabilities, every expert picked equally) scores 1
    uniform = layer_losses(torch.zeros(8, 4).scatter(1, torch.arange(8)[:, None] % 4, 1e-9), 1)
    assert abs(float(uniform["load_balancing_loss"]) - 1.0) < 1e-6


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--train-backend", "fsdp", "--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2"),
        (
            [
                "--train-backend",
                "fsdp",
                "--moe-aux-loss-coeff",
                "0.01",
                "--moe-router-load-balancing-type",
                "seq_aux_loss",
            ],
            "--moe-router-load-balancing-type seq_aux_loss",
        ),
        (["--expert-model-parallel-size", "3", "--actor-num-gpus-per-node", "4"], "--expert-model-parallel-size 3"),
        (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff -1"),
        (
            [
                "--moe-token-dispatcher-type",
                "allgather",
                "--expert-model-parallel-size",
                "2",
                "--actor-num-gpus-per-node",
                "2",
            ],
            "--moe-token-dispatcher-type allgather with --expert-model-parallel-size 2",
        ),
        (
            ["--expert-tensor-parallel-size", "3", "--tensor-model-parallel-size", "2"],
            "--expert-tensor-parallel-size 3",
        ),
    ],
)
def test_moe_flags_are_checked(flags, fragment):
    from rl_plugin.arguments import parse_args
    from rl_plugin.errors import RLArgumentError

    with pytest.raises(RLArgumentError, match=fragment.replace("-", r"\-")):
        parse_args(flags)
