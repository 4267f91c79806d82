"""Bundle order and the group checks (``rl_plugin.ray.bundle_order``): pure functions over
(bundle, node, GPU ids) sites; the placement on a real multi-node cluster is ``test_placement.py``."""

from __future__ import annotations

import pytest

from rl_plugin.errors import LoopError
from rl_plugin.ray.bundle_order import BundleSite, check_groups_within_nodes, check_node_count, sorted_sites


def _site(bundle, node, ip, *gpus):
    return BundleSite(bundle, node, ip, tuple(gpus))


def test_bundles_sort_by_node_then_gpu_id():
    # PACK's order: bundles alternate nodes, GPU ids out of order; ip 10.0.0.10 > 10.0.0.9 numerically
    table = [
        _site(0, "nodeB", "10.0.0.10", 1),
        _site(1, "nodeA", "10.0.0.9", 3),
        _site(2, "nodeB", "10.0.0.10", 0),
        _site(3, "nodeA", "10.0.0.9", 2),
        _site(4, "nodeA", "10.0.0.9", 10),
        _site(5, "nodeB", "10.0.0.10", 2),
    ]
    order = sorted_sites(table)
    assert [s.bundle for s in order] == [3, 1, 4, 2, 0, 5]
    assert [s.node_id for s in order] == ["nodeA"] * 3 + ["nodeB"] * 3
    assert [s.gpu_ids[0] for s in order] == [2, 3, 10, 0, 1, 2]
    check_groups_within_nodes(order, 3, "a TP x CP")  # 3 + 3: every group of 3 on one node
    # nodes sharing one ip (a local test cluster): the node id separates them; no GPUs: bundle order
    same_ip = [_site(0, "n2", "127.0.0.1"), _site(1, "n1", "127.0.0.1"), _site(2, "n2", "127.0.0.1")]
    assert [s.bundle for s in sorted_sites(same_ip)] == [1, 0, 2]


def test_a_group_across_two_nodes_is_refused_naming_ranks_and_nodes():
    order = sorted_sites(
        [_site(b, "nodeA" if b < 3 else "nodeB", "10.0.0.1" if b < 3 else "10.0.0.2", b) for b in range(4)]
    )
    check_groups_within_nodes(order, 1, "a TP x CP")
    with pytest.raises(
        LoopError,
        match=r"a TP x CP group of ranks 2-3 would span nodes node 10\.0\.0\.1 \(nodeA\) GPUs \[2\], node 10\.0\.0\.2 \(nodeB\) GPUs \[3\].*node 10\.0\.0\.1 \(nodeA\): 3, node 10\.0\.0\.2 \(nodeB\): 1.*multiple of 2",
    ):
        check_groups_within_nodes(order, 2, "a TP x CP")


def test_node_count_beyond_the_alive_nodes_is_refused():
    check_node_count(2, 2, "GPU")
    with pytest.raises(LoopError, match=r"--actor-num-nodes 3: the Ray cluster has 2 alive node\(s\) with GPUs"):
        check_node_count(3, 2, "GPU")


def test_the_critics_checks_name_the_critics_flags():
    """PPO's critic (issue 47) has bundles of its own: its refusals name --critic-num-*."""
    with pytest.raises(LoopError) as err:
        check_node_count(3, 2, "GPU", role="critic")
    msg = str(err.value)
    assert msg.startswith("--critic-num-nodes 3: the Ray cluster has 2 alive node(s) with GPUs"), msg
    assert "use --critic-num-nodes 2 with more --critic-num-gpus-per-node" in msg, msg
    order = sorted_sites([_site(b, f"node{b}", f"10.0.0.{b + 1}", 0) for b in range(2)])
    with pytest.raises(LoopError) as err:
        check_groups_within_nodes(order, 2, "the critic's TP x CP", role="critic")
    msg = str(err.value)
    assert "the critic's TP x CP group of ranks 0-1 would span nodes" in msg, msg
    assert "Ray placed the critic's training bundles" in msg and "(--critic-num-gpus-per-node, a multiple" in msg, msg
