"""The cluster flags' rules (``rl_plugin.configs.cluster``) and the world size, computed there only."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.cluster import ClusterConfig
from tests.support.flag_rules import assert_refused

RULES = [
    ("--actor-num-nodes 0", ["--actor-num-nodes: must be >= 1 (got 0)", "e.g. --actor-num-nodes 1"]),
    ("--actor-num-gpus-per-node -2", ["--actor-num-gpus-per-node: must be >= 1 (got -2)"]),
    ("--rollout-num-gpus 0", ["--rollout-num-gpus: must be >= 1 (got 0)"]),
    ("--ray-num-cpus 0", ["--ray-num-cpus: must be >= 1 (got 0)", "e.g. --ray-num-cpus 1"]),
    (
        "--colocate --rollout-num-gpus 2",
        ["--colocate with --rollout-num-gpus", "would be ignored", "drop --rollout-num-gpus, or drop --colocate"],
    ),
    (
        "--rollout-engine vllm --rollout-num-gpus 3 --rollout-num-gpus-per-engine 2",
        ["--rollout-num-gpus 3 with --rollout-num-gpus-per-engine 2", "whole engines", "a multiple of 2"],
    ),
    (
        "--actor-num-nodes 1 --actor-num-gpus-per-node 3 --tensor-model-parallel-size 2",
        [
            "--actor-num-nodes 1 x --actor-num-gpus-per-node 3 = 3 training ranks",
            "a multiple of TP x CP x PP = 2",
        ],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        "--actor-num-nodes 2 --actor-num-gpus-per-node 4 --tensor-model-parallel-size 2",
        "--rollout-engine vllm --rollout-num-gpus 4 --rollout-num-gpus-per-engine 2",
        "--colocate",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


@pytest.mark.parametrize("nodes, per_node", [(1, 1), (2, 4), (3, 8)])
def test_world_size_is_nodes_times_processes_per_node(nodes, per_node):
    assert ClusterConfig(actor_num_nodes=nodes, actor_num_gpus_per_node=per_node).world_size == nodes * per_node


def test_defaults():
    c = ClusterConfig()
    assert (c.actor_num_nodes, c.actor_num_gpus_per_node, c.world_size) == (1, 1, 1)
    assert (c.rollout_num_gpus, c.colocate, c.placement_device, c.ray_num_cpus) == (None, False, "auto", None)
