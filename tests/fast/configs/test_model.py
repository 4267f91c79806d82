"""The model and MoE flags' rules (``rl_plugin.configs.model``): each refused combination names the
flags, the rule and the fix; ``model_parallel_size`` is TP x CP x PP."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.model import ModelConfig, MoEConfig
from tests.support.flag_rules import assert_refused

FSDP = "--train-backend fsdp --hf-checkpoint /nonexistent"

RULES = [
    ("--expert-model-parallel-size 0", ["--expert-model-parallel-size 0: must be >= 1"]),
    ("--expert-tensor-parallel-size 0", ["--expert-tensor-parallel-size 0: must be >= 1", "drop the flag"]),
    ("--moe-aux-loss-coeff -0.1", ["--moe-aux-loss-coeff -0.1: a loss coefficient must be >= 0"]),
    ("--moe-z-loss-coeff -1", ["--moe-z-loss-coeff -1.0: a loss coefficient must be >= 0", "--moe-z-loss-coeff 0.001"]),
    (
        "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 4 --actor-num-gpus-per-node 2",
        [
            "--expert-tensor-parallel-size 4 with --tensor-model-parallel-size 2",
            "use --expert-tensor-parallel-size 1 or 2",
        ],
    ),
    (
        "--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather --actor-num-gpus-per-node 2",
        ["--moe-token-dispatcher-type allgather with --expert-model-parallel-size 2", "alltoall"],
    ),
    (
        "--expert-model-parallel-size 2 --actor-num-gpus-per-node 3",
        ["--expert-model-parallel-size 2 with 3 training processes", "world / PP (3)", "expert-TP (1) x EP (2)"],
    ),
    (
        f"{FSDP} --expert-model-parallel-size 2 --actor-num-gpus-per-node 2",
        ["--train-backend fsdp with --expert-model-parallel-size 2", "drop --expert-model-parallel-size"],
    ),
    (f"{FSDP} --expert-tensor-parallel-size 1", ["--train-backend fsdp with --expert-tensor-parallel-size 1"]),
    (f"{FSDP} --moe-router-dtype fp32", ["--train-backend fsdp with --moe-router-dtype fp32"]),
    (
        f"{FSDP} --moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01",
        ["--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01", "aux_loss only"],
    ),
    (
        "--num-layers-per-virtual-pipeline-stage 2 --num-virtual-stages-per-pipeline-rank 2",
        ["--num-layers-per-virtual-pipeline-stage 2 with --num-virtual-stages-per-pipeline-rank 2", "only one of them"],
    ),
    (
        "--num-layers-per-virtual-pipeline-stage 2",
        ["--num-layers-per-virtual-pipeline-stage 2 with --pipeline-model-parallel-size 1", "add --pipeline-model"],
    ),
    (
        "--num-virtual-stages-per-pipeline-rank 3",
        ["--num-virtual-stages-per-pipeline-rank 3 with --pipeline-model-parallel-size 1"],
    ),
    ("--num-virtual-stages-per-pipeline-rank 0", ["--num-virtual-stages-per-pipeline-rank: must be >= 1 (got 0)"]),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        "--expert-model-parallel-size 2 --actor-num-gpus-per-node 2",
        "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2 --actor-num-gpus-per-node 2",
        "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 2 --actor-num-gpus-per-node 4",
        f"{FSDP} --moe-aux-loss-coeff 0.01",
        "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --actor-num-gpus-per-node 2",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


@pytest.mark.parametrize("tp, cp, pp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 3, 4)])
def test_model_parallel_size_is_tp_cp_pp(tp, cp, pp):
    model = ModelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp)
    assert model.model_parallel_size == tp * cp * pp


def test_moe_defaults():
    moe = MoEConfig()
    assert (moe.expert_model_parallel_size, moe.expert_tensor_parallel_size) == (1, None)
    assert (moe.router_load_balancing_type, moe.aux_loss_coeff, moe.token_dispatcher_type) == (
        "aux_loss",
        0.0,
        "alltoall",
    )
