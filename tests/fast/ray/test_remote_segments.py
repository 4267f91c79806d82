"""Issue 23 #6: the weight segments of a SIGKILLed train rank 0 are swept on ITS node, which may
not be the driver's (``train_group.sweep_node_segments``: a task placed on that node). A local
Ray cluster of two nodes; the segment's creator lives on the second one and is SIGKILLed."""

from __future__ import annotations

import os
import signal

import pytest
import torch

ray = pytest.importorskip("ray")


class SegmentOwner:
    def create(self):
        from rl_plugin.weight_sync.segment import SharedWeightSegment, WeightLayout

        self.seg = SharedWeightSegment.create(WeightLayout.of({"w": torch.zeros(16)}))
        return str(self.seg.path), os.getpid(), ray.get_runtime_context().get_node_id()


def test_a_dead_rank0s_segment_is_swept_on_its_node():
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rl_plugin.ray.train_group import sweep_node_segments

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    other = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    try:
        strategy = NodeAffinitySchedulingStrategy(other.node_id, soft=False)
        owner = ray.remote(SegmentOwner).options(scheduling_strategy=strategy, num_cpus=0).remote()
        path, pid, node = ray.get(owner.create.remote())
        assert node == other.node_id and os.path.exists(path)
        os.kill(pid, signal.SIGKILL)  # no close(): the segment stays
        assert os.path.exists(path)
        assert sweep_node_segments(node, [pid]) == [path]
        assert not os.path.exists(path)
    finally:
        ray.shutdown()
        cluster.shutdown()
