"""Placement follows the Ray cluster, not the driver (``rl_plugin.ray.cluster``,
``rl_plugin.ray.bundle_order``, ``rl_plugin.ray.gpu_check``).

The sort and the group check (pure functions over sites) are ``test_bundle_order.py``, the
bundles that never fit ``test_capacity.py``. The real test starts a local multi-node Ray cluster (``ray.cluster_utils.Cluster``): a head without GPUs
(the driver's node) and two nodes with two LOGICAL GPUs each. Placement must choose GPU bundles
from the cluster's resources although the driver has no CUDA, put each TP group on one node in
GPU order, refuse --actor-num-nodes beyond the alive GPU nodes, and a training actor on such a
GPU bundle (there is no real GPU here) must fail loud naming its node."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import ray
import torch

from rl_plugin.errors import LoopError, RLArgumentError
from rl_plugin.ray.bundle_order import sorted_sites
from rl_plugin.ray.cluster import create_placement, placement_uses_gpus
from tests.support.placement import placement_config


def test_device_choice():
    assert placement_uses_gpus("auto", 4.0) is True
    assert placement_uses_gpus("auto", 0) is False
    assert placement_uses_gpus("cpu", 8.0) is False
    assert placement_uses_gpus("gpu", 1.0) is True
    with pytest.raises(LoopError, match=r"--placement-device gpu: the Ray cluster has no GPUs"):
        placement_uses_gpus("gpu", 0)


@pytest.fixture(scope="module")
def logical_gpu_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    store = 80 * 1024 * 1024
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=1, num_gpus=0, object_store_memory=store, include_dashboard=False),
    )
    gpu_nodes = [cluster.add_node(num_cpus=2, num_gpus=2, object_store_memory=store) for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, {n.node_id for n in gpu_nodes}
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the driver must have no CUDA (the point of the test)")
def test_placement_on_a_multi_node_logical_gpu_cluster(logical_gpu_cluster):
    from rl_plugin.ray.train_group import TrainActorError, TrainGroup

    _, gpu_nodes = logical_gpu_cluster
    with pytest.raises(LoopError, match=r"--actor-num-nodes 3: the Ray cluster has 2 alive node\(s\) with GPUs"):
        create_placement(placement_config(actor_num_nodes=3))

    p = create_placement(placement_config())
    try:
        assert p.gpus  # from ray.cluster_resources(): the driver itself has no CUDA
        sites = p.train_sites
        assert [s.bundle for s in sites] == p.train_bundles and sorted(p.train_bundles) == [0, 1, 2, 3]
        assert {s.node_id for s in sites} == gpu_nodes  # never the head (no GPUs)
        # TP = 2: ranks (0, 1) and (2, 3) each on one node, in GPU id order
        assert sites[0].node_id == sites[1].node_id != sites[2].node_id == sites[3].node_id
        assert sites == sorted_sites(sites)
        assert [s.gpu_ids for s in sites[:2]] == [(0,), (1,)] and [s.gpu_ids for s in sites[2:]] == [(0,), (1,)]
        # the colocated manager and engine share rank 0's bundle
        assert p.rollout_bundle == p.train_bundles[0]
        assert p.threads.train.single and p.threads.rollout.single  # GPUs: one torch thread each

        with pytest.raises(TrainActorError) as err:  # the loop's own path: the group's first call fails
            TrainGroup(placement_config().train, p)
        r, text = err.value.rank, str(err.value)
        assert f"GPUPlacementError: train rank {r} was placed on a GPU bundle" in text
        assert f"node id {sites[r].node_id}" in text and "sees no CUDA" in text
    finally:
        p.remove()

    # colocated vLLM engines of 2 GPUs (issue 37): engine i on rank 2i's bundle, tensor-parallel over
    # the GPUs of ranks 2i and 2i + 1 (one node), which its actor is told to see
    tp = create_placement(placement_config(rollout_engine="vllm", rollout_num_gpus_per_engine=2))
    try:
        sites = tp.train_sites
        assert tp.engine_bundles == [tp.train_bundles[0], tp.train_bundles[2]]
        assert tp.engine_devices == ["0,1", "0,1"] and sites[0].node_id != sites[2].node_id
        env = tp.engine_options(1)["runtime_env"]["env_vars"]
        assert env == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    finally:
        tp.remove()
    with pytest.raises(RLArgumentError, match="--colocate with --update-weight-transport distributed on GPUs"):
        create_placement(
            placement_config(update_weight_transport="distributed")
        )  # refused before any bundle is reserved

    cpu = create_placement(placement_config(placement_device="cpu", actor_num_nodes=1, actor_num_gpus_per_node=2))
    try:  # CPU bundles on a GPU cluster when asked: no GPU ids, rank order = bundle order on one node
        assert not cpu.gpus and [s.gpu_ids for s in cpu.train_sites] == [(), ()]
        # colocated: phases in sequence; the two ranks share their node, the hf engine has its own turn
        t = cpu.threads
        assert (t.train.busy, t.train.single, t.rollout.busy, t.rollout.single) == (2, False, 1, False)
    finally:
        cpu.remove()
    # overlapped, one rank beside the manager's hf engine (PACK: one node): both phases share it
    ahead = create_placement(
        placement_config(
            placement_device="cpu", actor_num_nodes=1, actor_num_gpus_per_node=1, colocate=False, max_weight_staleness=1
        )
    )
    try:
        t = ahead.threads
        assert (t.train.busy, t.rollout.busy, t.engine.single) == (2, 2, True)
    finally:
        ahead.remove()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the driver must have no CUDA (the point of the test)")
def test_a_gpu_shortfall_fails_in_seconds_and_a_multi_gpu_vllm_engine_follows_the_cluster(logical_gpu_cluster):
    """Issue 37 #14: 4 logical GPUs, 2 x 2 training ranks plus the disaggregated hf engine's GPU =
    5 are refused at once with the project's message (before: a 300 s wait, then a RuntimeError).
    Issue 37 #6: a vLLM engine of 2 GPUs is placed on the GPU nodes although the driver has no CUDA,
    and refused on CPU bundles."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(LoopError) as err:
        create_placement(placement_config(colocate=False))
    took = time.perf_counter() - t0
    print(f"refused in {took:.2f} s")  # ~0.01 s here; the placement wait was 300 s
    msg = str(err.value)
    assert "Ray cannot place the run's 5 bundles" in msg and "they ask for 5 GPUs, the Ray cluster has 4" in msg, msg
    assert "Fix: --colocate" in msg, msg
    assert took < 60  # far below the 300 s placement wait (not a timing assertion: a hang guard)
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )  # nothing reserved

    vllm = placement_config(colocate=False, actor_num_nodes=1, rollout_engine="vllm", rollout_num_gpus_per_engine=2)
    p = create_placement(vllm)
    try:
        assert p.gpus and p.num_engines == 1 and p.gpus_per_engine == 2
        assert p.engine_options(0)["num_gpus"] == 2  # one engine holding 2 GPUs of one node
    finally:
        p.remove()
    with pytest.raises(RLArgumentError, match=r"--rollout-num-gpus-per-engine 2 with --placement-device cpu on a Ray"):
        create_placement(replace(vllm, cluster=replace(vllm.cluster, placement_device="cpu")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the driver must have no CUDA (the point of the test)")
def test_the_critic_gets_bundles_of_its_own_or_the_actors(logical_gpu_cluster):
    """PPO's critic (issue 47) on the two nodes of 2 logical GPUs: disaggregated, 2 critic bundles of
    its own beside the actor's rank and the hf engine's GPU (4 of 4 GPUs), in (node, GPU id) order,
    no GPU shared with the actor or the engine, and its group's actors on them (they fail loud, as
    the actor's do: no CUDA here, naming the critic bundle's node); colocated, the actor's bundles;
    a critic the cluster cannot hold is refused in seconds naming its flags."""
    import time

    from rl_plugin.ray.bundle_order import bundle_sites
    from rl_plugin.ray.critic_group import make_critic_group
    from rl_plugin.ray.train_group import TrainActorError

    _, gpu_nodes = logical_gpu_cluster
    apart = dict(actor_num_nodes=1, colocate=False, advantage_estimator="ppo")
    run = placement_config(**apart, actor_num_gpus_per_node=1, tensor_model_parallel_size=1, critic_num_gpus_per_node=2)
    p = create_placement(run)
    try:
        sites = p.critic_sites
        assert sorted(p.critic_bundles) == [2, 3] and [s.bundle for s in sites] == p.critic_bundles  # after the others'
        assert sites == sorted_sites(sites) and {s.node_id for s in sites} <= gpu_nodes  # never the head
        (engine,) = bundle_sites(p.pg, [p.rollout_bundle], [1])  # the hf engine in the manager holds 1 GPU
        held = [(s.node_id, s.gpu_ids) for s in [*p.train_sites, *sites, engine]]
        assert len(set(held)) == 4 and all(len(g) == 1 for _, g in held), held  # one GPU each, none shared
        assert p.for_critic().world_size == 2 and p.train_options(0)["num_gpus"] == 1.0
        with pytest.raises(TrainActorError) as err:  # the loop's path: the critic group's first call fails
            make_critic_group(run, p)
        r, text = err.value.rank, str(err.value)
        assert f"GPUPlacementError: train rank {r} was placed on a GPU bundle" in text
        assert f"node id {sites[r].node_id}" in text, text
    finally:
        p.remove()

    together = create_placement(placement_config(advantage_estimator="ppo"))  # 2 x 2 ranks, TP 2, colocated
    try:
        assert together.critic_bundles == together.train_bundles and together.critic_sites == together.train_sites
        assert together.for_critic().train_options(3)["num_gpus"] == together.train_options(3)["num_gpus"] == 0.375
    finally:
        together.remove()

    cpu = create_placement(placement_config(**apart, placement_device="cpu", actor_num_gpus_per_node=1))
    try:  # CPU bundles as the actor's: one CPU each, no GPU ids
        assert cpu.critic_bundles == [2] and cpu.critic_sites[0].gpu_ids == () and not cpu.gpus
        assert cpu.for_critic().train_options(0)["num_gpus"] == 0
    finally:
        cpu.remove()

    t0 = time.perf_counter()
    with pytest.raises(LoopError) as err:  # 2 actor ranks + 2 critic ranks + the engine's GPU = 5 > 4
        create_placement(placement_config(**apart))
    took, msg = time.perf_counter() - t0, str(err.value)
    assert "they ask for 5 GPUs, the Ray cluster has 4" in msg, msg
    assert "the critic: 2 training rank(s) of 1 GPU (--critic-num-nodes 1 x --critic-num-gpus-per-node 2)" in msg, msg
    assert took < 60  # a hang guard: far below the 300 s placement wait
    with pytest.raises(LoopError, match=r"--critic-num-nodes 3: the Ray cluster has 2 alive node\(s\) with GPUs"):
        create_placement(placement_config(**apart, critic_num_nodes=3))
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())  # nothing left held
