"""Which training rank runs on which placement-group bundle, and where the bundles are.

Ray's ``PACK`` strategy reserves the bundles but keeps them in request order: bundle 1 may sit
on another node than bundles 0 and 2, and a node's GPUs come in any order. Megatron numbers its
ranks TP first, then CP, then DP (``initialize_model_parallel``'s ``tp-cp-ep-dp-pp``), so a TP
(and CP) group is a run of ``TP * CP`` consecutive ranks. The loop therefore

1. finds every training bundle's node and GPU ids (``bundle_sites``: the node from
   ``ray.util.placement_group_table``; on GPU bundles the GPU ids from a probe task placed on
   the bundle, ``ray.get_gpu_ids()``, the ids Ray then gives an actor on that bundle),
2. sorts them by (node ip, node id, first GPU id, bundle index) (``sorted_sites``): the nodes'
   ranks come out contiguous, in GPU order within a node,
3. maps training rank r to sorted bundle r, and refuses a layout where some run of ``TP * CP``
   consecutive ranks spans two nodes (``check_groups_within_nodes``; a node holding a number of
   training bundles that is not a multiple of ``TP * CP``).

The node count is checked first (``check_node_count``): ``--actor-num-nodes N`` needs N alive
nodes with the bundles' device, else the run is refused with both numbers. PPO's critic
(``--critic-num-nodes``) has its own bundles, ordered and checked the same way (``role="critic"``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from rl_plugin.errors import LoopError


@dataclass(frozen=True)
class BundleSite:
    """Where bundle ``bundle`` of a placement group was reserved."""

    bundle: int
    node_id: str
    node_ip: str
    gpu_ids: Tuple[Any, ...] = ()

    def node(self) -> str:
        return f"node {self.node_ip} ({self.node_id[:12]})"

    def where(self) -> str:
        return self.node() + (f" GPUs {list(self.gpu_ids)}" if self.gpu_ids else "")


def _ip_key(ip: str) -> Tuple[int, Any]:
    try:
        addr = ipaddress.ip_address(ip)
        return (addr.version, int(addr))
    except ValueError:  # a host name: after the addresses, in name order
        return (99, ip)


def _gpu_key(gpu_ids: Sequence[Any]) -> Tuple[Tuple[int, Any], ...]:
    return tuple((0, int(g)) if str(g).isdigit() else (1, str(g)) for g in gpu_ids)


def site_key(site: BundleSite) -> tuple:
    """The sort key: node ip (numerically), node id (several nodes share one ip on a local test
    cluster), GPU ids (numerically), then the bundle index."""
    return (_ip_key(site.node_ip), site.node_id, _gpu_key(site.gpu_ids), site.bundle)


def sorted_sites(sites: Sequence[BundleSite]) -> List[BundleSite]:
    """The sites in rank order: rank r runs on ``sorted_sites(sites)[r].bundle``."""
    return sorted(sites, key=site_key)


def check_groups_within_nodes(ordered: Sequence[BundleSite], group_size: int, what: str, role: str = "actor") -> None:
    """Raise ``LoopError`` when a run of ``group_size`` consecutive ranks of ``ordered`` (rank
    order) spans more than one node, naming the ranks, their nodes and the bundles per node;
    ``role``: whose ranks (``actor`` or ``critic``: the flags the fix names)."""
    if group_size <= 1:
        return
    for start in range(0, len(ordered), group_size):
        group = ordered[start : start + group_size]
        nodes = sorted({s.node_id for s in group})
        if len(nodes) > 1:
            per_node: Dict[str, int] = {}
            for s in ordered:
                per_node[s.node()] = per_node.get(s.node(), 0) + 1
            spread = ", ".join(f"{n}: {k}" for n, k in per_node.items())
            ranks = f"ranks {start}-{start + len(group) - 1}"
            raise LoopError(
                f"{what} group of {ranks} would span nodes "
                f"{', '.join(s.where() for s in group)}: Ray placed the {role}'s training bundles {spread} "
                f"(each node needs a multiple of {group_size}). Fix: give every node the same number of "
                f"free GPUs for training (--{role}-num-gpus-per-node, a multiple of TP x CP), or move the "
                "rollout engines off the training nodes"
            )


def check_node_count(asked: int, alive: int, device: str, role: str = "actor") -> None:
    """``--<role>-num-nodes asked`` (``actor``, or ``critic``: PPO's value model) on a cluster with
    ``alive`` alive nodes that have ``device``."""
    if asked > alive:
        raise LoopError(
            f"--{role}-num-nodes {asked}: the Ray cluster has {alive} alive node(s) with {device}s, fewer "
            f"than the {asked} asked for (the ranks would silently share fewer nodes). Fix: start the "
            f"missing node(s) (`ray start --address=<head>` on each), or use --{role}-num-nodes {alive} "
            f"with more --{role}-num-gpus-per-node; `ray status` lists the nodes"
        )


def alive_nodes_with(resource: str) -> int:
    """Alive nodes of the connected Ray cluster offering ``resource`` (``GPU`` or ``CPU``)."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0)


def bundle_sites(pg, bundles: Sequence[int], num_gpus: Sequence[float]) -> List[BundleSite]:
    """The sites of ``bundles`` of the ready placement group ``pg``; ``num_gpus[i]``: the GPUs of
    ``bundles[i]`` (0: the node only, from the placement group table, no probe task)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    gpu_ids: Dict[int, Tuple[Any, ...]] = {}
    probe = ray.remote(_gpu_ids)
    refs = {
        b: probe.options(
            num_cpus=0,
            num_gpus=g,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
        ).remote()
        for b, g in zip(bundles, num_gpus)
        if g
    }
    for b, ref in refs.items():
        gpu_ids[b] = tuple(ray.get(ref, timeout=120))
    return [BundleSite(b, node_of[b], ip_of.get(node_of[b], "?"), gpu_ids.get(b, ())) for b in bundles]


def _gpu_ids() -> List[Any]:
    import ray

    return list(ray.get_gpu_ids())
