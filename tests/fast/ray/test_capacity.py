"""Bundles that can never fit the Ray cluster (``rl_plugin.ray.capacity``): the shortfall in
numbers, and the refusal naming what asks for the GPUs, the cluster's nodes and the fix."""

from __future__ import annotations

import pytest

from rl_plugin.errors import LoopError
from rl_plugin.ray.capacity import check_bundles_fit, shortfall
from tests.support.placement import placement_config


def test_bundles_that_never_fit_are_refused_naming_ask_cluster_and_fix():
    """Issue 37 #14 as numbers: a driver node without GPUs and one node with 2 GPUs; 2 training
    ranks plus the hf engine inside the rollout manager ask for 3 GPUs."""
    nodes = [
        {"NodeID": "head" * 4, "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 4.0}},
        {"NodeID": "gpu0" * 4, "NodeManagerAddress": "10.0.0.2", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0}},
        {"NodeID": "dead" * 4, "NodeManagerAddress": "10.0.0.3", "Alive": False, "Resources": {"CPU": 8.0, "GPU": 8.0}},
    ]
    args = placement_config(actor_num_nodes=1, colocate=False, tensor_model_parallel_size=1)
    bundles = [{"CPU": 1, "GPU": 1}] * 3
    assert shortfall(bundles, [n["Resources"] for n in nodes[:2]]) == "they ask for 3 GPUs, the Ray cluster has 2"
    with pytest.raises(LoopError) as err:
        check_bundles_fit(args, bundles, nodes, world=2, engines=0, gpus=True)
    msg = str(err.value)
    assert "they ask for 3 GPUs, the Ray cluster has 2" in msg, msg  # the dead node's 8 GPUs do not count
    assert "2 training rank(s) of 1 GPU (--actor-num-nodes 1 x --actor-num-gpus-per-node 2)" in msg, msg
    assert "the rollout manager holding the hf engine (1 GPU, --rollout-num-gpus)" in msg, msg
    assert "node 10.0.0.1 (headheadhead): 0 GPUs, 4 CPUs; node 10.0.0.2 (gpu0gpu0gpu0): 2 GPUs, 8 CPUs" in msg, msg
    assert "Fix: --colocate" in msg and "--placement-device cpu" in msg, msg
    check_bundles_fit(args, bundles[:2], nodes, world=2, engines=0, gpus=True)  # 2 of 2: fits
    # enough GPUs in total, but an engine of 4 GPUs spans no single node
    wide = [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 4}]
    two_nodes = [{"CPU": 4.0, "GPU": 3.0}, {"CPU": 4.0, "GPU": 3.0}]
    assert "no node has that much (the most GPUs on one node: 3)" in shortfall(wide, two_nodes)
    assert shortfall([{"CPU": 1}] * 9, [{"CPU": 8.0}]) == "they ask for 9 CPUs, the Ray cluster has 8"


def test_a_critic_the_cluster_cannot_hold_is_refused_naming_the_critics_ask():
    """PPO's critic (issue 47) asks for bundles of its own: 2 actor ranks + 2 critic ranks + the hf
    engine's GPU = 5 GPUs on a cluster of 4; the refusal names the critic's flags and the fixes."""
    nodes = [
        {
            "NodeID": f"gpu{i}" * 4,
            "NodeManagerAddress": f"10.0.0.{i}",
            "Alive": True,
            "Resources": {"CPU": 4.0, "GPU": 2.0},
        }
        for i in (1, 2)
    ]
    run = placement_config(actor_num_nodes=1, colocate=False, advantage_estimator="ppo", critic_num_gpus_per_node=2)
    bundles = [{"CPU": 1, "GPU": 1}] * 2 + [{"CPU": 1, "GPU": 1}] + [{"CPU": 1, "GPU": 1}] * 2
    with pytest.raises(LoopError) as err:
        check_bundles_fit(run, bundles, nodes, world=2, engines=0, gpus=True)
    msg = str(err.value)
    assert "they ask for 5 GPUs, the Ray cluster has 4" in msg, msg
    assert "the critic: 2 training rank(s) of 1 GPU (--critic-num-nodes 1 x --critic-num-gpus-per-node 2)" in msg, msg
    assert "Fix: --colocate (the critic and the rollout engines share the training GPUs)" in msg, msg
    assert "a smaller critic (--critic-num-nodes, --critic-num-gpus-per-node)" in msg, msg
    colocated = placement_config(advantage_estimator="ppo")  # 2 x 2 actor ranks, the critic on their bundles
    with pytest.raises(LoopError) as err:
        check_bundles_fit(colocated, [{"CPU": 1, "GPU": 1}] * 5, nodes, world=4, engines=0, gpus=True)
    assert "the critic's 4 rank(s) on the training bundles (--colocate)" in str(err.value), str(err.value)
    cpu = placement_config(actor_num_nodes=1, colocate=False, advantage_estimator="ppo")
    with pytest.raises(
        LoopError, match=r"fewer processes \(--actor-num-gpus-per-node, --rollout-num-gpus, --critic-num"
    ):
        check_bundles_fit(cpu, [{"CPU": 1}] * 9, [{"Alive": True, "Resources": {"CPU": 8.0}}], 2, 0, gpus=False)
