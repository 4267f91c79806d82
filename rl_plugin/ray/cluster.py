"""Starting or joining a Ray cluster, and placing the loop's actors with placement groups.

``RAY_ADDRESS`` set: join that cluster. Otherwise start a small local one (no dashboard, only
the CPUs the placement needs) with ``RAY_AUTH_MODE=disabled`` unless the caller chose a mode,
watched by ``rl_plugin.ray.reaper`` so that the whole local cluster (its agents included) ends
with the driver, even when the driver is SIGKILLed.

Placement: one bundle per training rank (``{"GPU": 1, "CPU": 1}``; on a machine without GPUs
``{"CPU": 1}``, so ``--actor-num-gpus-per-node N`` means N CPU training processes). Disaggregated,
the rollout gets its own bundle (``--rollout-num-gpus`` GPUs, or one CPU); with ``--colocate`` it
shares bundle 0 with training rank 0 (fractional resources, time-shared).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_plugin.ray.reaper import Reaper, children, start_reaper

COLOCATED_TRAIN_SHARE = 0.75  # of a bundle's GPU/CPU for the training actor when colocated


def use_gpus() -> bool:
    import torch

    return torch.cuda.is_available()


def init_ray(num_cpus: int) -> bool:
    """Join ``RAY_ADDRESS`` if set, else start a local cluster with ``num_cpus`` logical CPUs.
    Returns False when Ray was already initialised by the caller (who then owns its shutdown)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        # CPU runs move tiny weights: a small object store. With GPUs, Ray's default (a share of
        # RAM) holds a full weight export, which travels through the object store at every sync.
        store = None if use_gpus() else 512 * 1024 * 1024
        global _REAPER
        before = set(children(os.getpid()))
        _REAPER = start_reaper()  # before ray.init(): a driver killed during start-up takes the cluster down too
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, object_store_memory=store)
        if _REAPER is not None:
            _REAPER.set_heads(sorted(set(children(os.getpid())) - before - {_REAPER.proc.pid}))  # the cluster's head processes
    return True


_REAPER: Optional[Reaper] = None


def shutdown_ray() -> None:
    global _REAPER
    if ray.is_initialized():
        ray.shutdown()
    if _REAPER is not None:
        _REAPER.stop()  # kills whatever of the local cluster outlived ray.shutdown()
        _REAPER = None


@dataclass
class Placement:
    pg: Any
    world_size: int
    gpus: bool
    colocate: bool
    rollout_bundle: int

    def train_options(self, rank: int) -> Dict[str, Any]:
        share = COLOCATED_TRAIN_SHARE if self.colocate else 1.0
        opts = dict(num_cpus=share, num_gpus=share if self.gpus else 0)
        return {**opts, "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)}

    def rollout_options(self, rollout_num_gpus: int) -> Dict[str, Any]:
        if self.colocate:
            share = 1.0 - COLOCATED_TRAIN_SHARE
            opts = dict(num_cpus=share, num_gpus=share if self.gpus else 0)
        else:
            opts = dict(num_cpus=1, num_gpus=rollout_num_gpus if self.gpus else 0)
        return {**opts, "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.rollout_bundle)}

    def remove(self) -> None:
        remove_placement_group(self.pg)


def required_cpus(args) -> int:
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    return world + (0 if args.colocate else 1)


def create_placement(args) -> Placement:
    gpus = use_gpus()
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    bundles: List[Dict[str, float]] = [{"CPU": 1, "GPU": 1} if gpus else {"CPU": 1} for _ in range(world)]
    rollout_bundle = 0
    if not args.colocate:
        n = args.rollout_num_gpus or 1
        bundles.append({"CPU": 1, "GPU": n} if gpus else {"CPU": 1})
        rollout_bundle = world
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=300)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {len(bundles)} bundles {bundles} in 300 s: the cluster lacks the resources for "
            f"--actor-num-nodes x --actor-num-gpus-per-node = {world} training ranks"
            + ("" if args.colocate else " plus the rollout (--rollout-num-gpus)") + ". Check `ray status`."
        ) from None
    return Placement(pg, world, gpus, bool(args.colocate), rollout_bundle)
