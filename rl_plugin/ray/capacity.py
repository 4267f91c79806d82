"""Can the Ray cluster ever hold the run's placement group? Asked before Ray is asked to wait.

``placement_group(bundles).ready()`` waits for resources that may never come: a run asking for
more GPUs than the cluster has (e.g. a driver node without GPUs beside one node with 2 GPUs, and
``--actor-num-gpus-per-node 2`` plus a disaggregated ``hf`` engine that holds one more GPU) would
wait out the placement timeout and then fail. ``check_bundles_fit`` compares the bundles with the
cluster's totals at once (``ray.nodes()``: every alive node's resources, which sum to
``ray.cluster_resources()``) and raises ``LoopError`` in seconds with what was asked, by whom,
what the cluster has, and the flags that change it.

Two necessary conditions, so a run that could be placed is never refused:

1. for each resource (GPU, CPU), the bundles' sum <= the cluster's total;
2. each bundle fits on one node (a bundle never spans nodes: an engine of
   ``--rollout-num-gpus-per-engine N`` needs N GPUs on one node).

The ask is named in the flags' terms (``describe_ask``): the training ranks, PPO's critic (its own
ranks, or the actor's bundles with ``--colocate``), the rollout manager and the engines.

Resources that exist but are held by other jobs are Ray's to wait for (``placement_timeout``).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from rl_plugin.errors import LoopError

Bundle = Mapping[str, float]


def _n(x: float) -> str:
    return f"{x:g}"


def shortfall(bundles: Sequence[Bundle], nodes: Sequence[Bundle]) -> Optional[str]:
    """Why ``bundles`` can never be placed on ``nodes`` (each node's total resources), or None.
    The reason names the resource and both numbers."""
    for res in ("GPU", "CPU"):
        asked = sum(b.get(res, 0) for b in bundles)
        have = sum(n.get(res, 0) for n in nodes)
        if asked > have:
            return f"they ask for {_n(asked)} {res}s, the Ray cluster has {_n(have)}"
    for b in bundles:
        if not any(all(n.get(res, 0) >= v for res, v in b.items()) for n in nodes):
            biggest = max((n.get("GPU", 0) for n in nodes), default=0)
            return (
                f"one bundle asks for {', '.join(f'{_n(v)} {k}' for k, v in b.items())} on a single node, and no node "
                f"has that much (the most GPUs on one node: {_n(biggest)})"
            )
    return None


def describe_ask(run, world: int, engines: int, gpus: bool) -> str:
    """Who asks for the bundles (``run``: the ``RunConfig``), in the flags' terms."""
    dev = "GPU" if gpus else "CPU"
    cluster, engine = run.cluster, run.rollout.engine
    parts = [
        f"{world} training rank(s) of 1 {dev} (--actor-num-nodes {cluster.actor_num_nodes} x "
        f"--actor-num-gpus-per-node {cluster.actor_num_gpus_per_node})"
    ]
    parts += _critic_ask(run, dev)
    if cluster.colocate:
        parts.append("the rollout engines on the training bundles (--colocate)")
    elif engines:
        per = engine.tensor_parallel_size
        parts.append("the rollout manager (1 CPU)")
        parts.append(
            f"{engines} {engine.engine} engine(s) of {per if gpus else 1} {dev} (--rollout-num-gpus "
            f"{cluster.rollout_num_gpus or per} / --rollout-num-gpus-per-engine {per})"
        )
    else:
        n = (cluster.rollout_num_gpus or engine.tensor_parallel_size) if gpus else 1
        parts.append(f"the rollout manager holding the {engine.engine} engine ({_n(n)} {dev}, --rollout-num-gpus)")
    return ", ".join(parts)


def _critic_ask(run, dev: str) -> List[str]:
    """PPO's critic (``--advantage-estimator ppo``): its bundles of its own, or the actor's."""
    critic = run.critic
    if not critic.enabled:
        return []
    n = critic.world_size(run)
    if run.cluster.colocate:
        return [f"the critic's {n} rank(s) on the training bundles (--colocate)"]
    return [
        f"the critic: {n} training rank(s) of 1 {dev} (--critic-num-nodes {critic.num_nodes(run)} x "
        f"--critic-num-gpus-per-node {critic.gpus_per_node(run)})"
    ]


def describe_nodes(nodes: Sequence[Mapping], key: str = "Resources") -> str:
    """``node <ip> (<id>): N GPUs, M CPUs`` per alive node of ``ray.nodes()``."""
    rows = []
    for n in nodes:
        r = n.get(key, {})
        rows.append(
            f"node {n.get('NodeManagerAddress', '?')} ({str(n.get('NodeID', '?'))[:12]}): "
            f"{_n(r.get('GPU', 0))} GPUs, {_n(r.get('CPU', 0))} CPUs"
        )
    return "; ".join(rows) or "no alive nodes"


def fixes(run, gpus: bool) -> str:
    if not gpus:
        return (
            "give the cluster more CPUs (--ray-num-cpus for the local cluster, `ray start --num-cpus N` on a node), "
            "or fewer processes (--actor-num-gpus-per-node, --rollout-num-gpus"
            + (", --critic-num-gpus-per-node)" if run.critic.enabled else ")")
        )
    out = []
    critic = run.critic.enabled
    if not run.cluster.colocate:
        shares = "the critic and the rollout engines share" if critic else "the rollout engines share"
        out.append(f"--colocate ({shares} the training GPUs)")
        out.append("fewer rollout GPUs (--rollout-num-gpus, --rollout-num-gpus-per-engine)")
        if critic:
            out.append("a smaller critic (--critic-num-nodes, --critic-num-gpus-per-node)")
    out.append("fewer training ranks (--actor-num-nodes, --actor-num-gpus-per-node)")
    out.append("more GPU nodes (`ray start --address=<head> --num-gpus N` on each)")
    out.append("--placement-device cpu (CPU processes, gloo)")
    return ", ".join(out)


def check_bundles_fit(run, bundles: Sequence[Bundle], nodes: Sequence[Mapping], world: int, engines: int, gpus: bool):
    """Raise ``LoopError`` naming the ask, the cluster and the fix when ``bundles`` can never be
    placed on the alive ``nodes`` (``ray.nodes()`` entries); ``run``: the ``RunConfig``."""
    alive: List[Mapping] = [n for n in nodes if n.get("Alive", True)]
    why = shortfall(bundles, [n.get("Resources", {}) for n in alive])
    if why is not None:
        raise LoopError(
            f"Ray cannot place the run's {len(bundles)} bundles {list(map(dict, bundles))}: {why}. Asked by "
            f"{describe_ask(run, world, engines, gpus)}. The cluster: {describe_nodes(alive)}. Fix: {fixes(run, gpus)}"
        )


def placement_timeout_error(
    run, bundles: Sequence[Bundle], available: Dict[str, float], timeout: float, world: int, engines: int, gpus: bool
) -> LoopError:
    """The bundles fit the cluster's totals but did not become free within ``timeout``: other
    jobs (or placement groups) hold what they need."""
    free = ", ".join(f"{_n(available.get(r, 0))} {r}s" for r in ("GPU", "CPU"))
    return LoopError(
        f"Ray could not place the run's {len(bundles)} bundles {list(map(dict, bundles))} within {timeout:g} s although "
        f"the cluster has them in total: other jobs hold them (free now: {free}). Asked by "
        f"{describe_ask(run, world, engines, gpus)}. Fix: wait for those jobs or stop them (`ray status` lists the "
        f"usage), or ask for less: {fixes(run, gpus)}"
    )
