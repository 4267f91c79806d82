"""ClusterConfig: where the loop's Ray actors run (training ranks, the rollout engines, their
placement). The engine's own size, ``--rollout-num-gpus-per-engine``, is ``EngineConfig``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs._checks import positive
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag

GROUP = "cluster"


@dataclass(frozen=True)
class ClusterConfig(Declared):
    actor_num_nodes: int = flag(
        "--actor-num-nodes", type=int, default=1, group=GROUP, help="Nodes for the training actors."
    )
    actor_num_gpus_per_node: int = flag(
        "--actor-num-gpus-per-node",
        type=int,
        default=1,
        group=GROUP,
        help="Training processes per node, one GPU each. On a machine without GPUs it is the number of CPU training processes (gloo), e.g. 2 for DP=2 on a laptop.",
    )
    rollout_num_gpus: Optional[int] = flag(
        "--rollout-num-gpus",
        type=int,
        default=None,
        group=GROUP,
        help="GPUs for all rollout engines together when disaggregated (slime's flag; default: one engine's worth). Engines = --rollout-num-gpus / --rollout-num-gpus-per-engine; a rollout's prompt groups are spread over them. On a CPU machine each engine is one CPU process instead of GPUs.",
    )
    colocate: bool = flag(
        "--colocate",
        action="store_true",
        group=GROUP,
        help="Put the rollout engine on the training GPUs (time-shared) instead of separate ones: fewer GPUs, no overlap of generation and training.",
    )
    placement_device: str = flag(
        "--placement-device",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        group=GROUP,
        help="Device of the training and engine bundles. auto: GPU bundles when the Ray cluster has GPUs (ray.cluster_resources(), whatever the driver's own machine has), else CPU bundles; gpu: require GPUs; cpu: CPU processes even on a GPU cluster (gloo).",
    )
    ray_num_cpus: Optional[int] = flag(
        "--ray-num-cpus",
        type=int,
        default=None,
        group=GROUP,
        help="CPUs of the local Ray cluster started when RAY_ADDRESS is unset (default: what the placement needs). Ignored when connecting to an existing cluster.",
    )

    @property
    def world_size(self) -> int:
        """Training ranks: ``--actor-num-nodes x --actor-num-gpus-per-node`` (computed here only)."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def check(self, run) -> None:
        for name, value in (
            ("--actor-num-nodes", self.actor_num_nodes),
            ("--actor-num-gpus-per-node", self.actor_num_gpus_per_node),
            ("--rollout-num-gpus", self.rollout_num_gpus),
            ("--ray-num-cpus", self.ray_num_cpus),
        ):
            positive(name, value, example=1)
        if self.colocate and self.rollout_num_gpus is not None:
            fail(
                "--colocate with --rollout-num-gpus",
                "a colocated rollout runs on the training GPUs, so a separate rollout GPU count would be ignored",
                "drop --rollout-num-gpus, or drop --colocate",
            )
        per_engine = run.rollout.engine.tensor_parallel_size
        if self.rollout_num_gpus is not None and per_engine is not None and self.rollout_num_gpus % per_engine != 0:
            fail(
                f"--rollout-num-gpus {self.rollout_num_gpus} with --rollout-num-gpus-per-engine {per_engine}",
                "the rollout GPUs must split into whole engines",
                f"use a multiple of {per_engine} for --rollout-num-gpus",
            )
        world = self.world_size
        model_parallel = run.train.model.model_parallel_size
        if world % model_parallel != 0:
            fail(
                f"--actor-num-nodes {self.actor_num_nodes} x --actor-num-gpus-per-node {self.actor_num_gpus_per_node} = {world} training ranks",
                f"the world must be a multiple of TP x CP x PP = {model_parallel}",
                f"use a world size that is a multiple of {model_parallel}",
            )
