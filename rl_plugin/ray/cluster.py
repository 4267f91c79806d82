"""Starting or joining a Ray cluster, and placing the loop's actors with placement groups.

``RAY_ADDRESS`` set: join that cluster. Otherwise start a small local one (no dashboard, only
the CPUs the placement needs), always a private one: ``ray.init(address="local")``, so another
cluster on the node (a ``ray start --head``, whose address file Ray's plain ``ray.init()`` would
join and then refuse ``num_cpus``; a second ``rl-plugin-train``) is neither joined nor touched: the
new cluster has its own session directory and its own ports (Ray picks free ones; only
``ray start`` writes the node's ``ray_current_cluster`` file, so the other cluster stays the one
``ray status`` and ``ray.init("auto")`` find) with ``RAY_AUTH_MODE=disabled`` unless the caller chose a mode,
watched by ``rl_plugin.ray.reaper`` so that the whole local cluster (its agents included) ends
with the driver, even when the driver is SIGKILLed.

Placement: one bundle per training rank (``{"GPU": 1, "CPU": 1}``; on a cluster without GPUs
``{"CPU": 1}``, so ``--actor-num-gpus-per-node N`` means N CPU training processes). GPU or CPU
bundles follow the Ray cluster's resources (``ray.cluster_resources()``), never the driver's own
device, unless ``--placement-device`` says (``placement_uses_gpus``). ``--actor-num-nodes N``
needs N alive nodes with that device. Training rank r runs on the r-th training bundle in
(node, GPU id) order, and a TP x CP group never spans two nodes (``rl_plugin.ray.bundle_order``);
an actor on a GPU bundle that sees no CUDA fails loud naming its node
(``rl_plugin.ray.gpu_check``). Disaggregated,
the rollout manager gets one bundle, and each engine process (``engine_processes``) one more
(``--rollout-num-gpus-per-engine`` GPUs, or one CPU). With ``--colocate`` the manager shares
rank 0's bundle and engine i that of rank ``i x --rollout-num-gpus-per-engine`` (fractional,
time-shared); a colocated engine of N GPUs runs tensor-parallel over the GPUs of ranks
``iN .. iN + N - 1`` (one node; its actor sees them through ``CUDA_VISIBLE_DEVICES``, which Ray is
told not to narrow to the one GPU of its bundle). Colocated on GPUs, the weights cannot travel over
NCCL (train rank 0 and engine 0 share a GPU): ``--update-weight-transport distributed`` is refused.
The ``hf`` engine with a single engine runs inside the manager (it then holds the rollout GPUs).
Engine bundles are in (node, GPU id) order too. PPO's critic (``--advantage-estimator ppo``) gets
``--critic-num-nodes x --critic-num-gpus-per-node`` bundles of its own (after the engines', GPU or
CPU as the actor's), in (node, GPU id) order with the same TP x CP rule; with ``--colocate`` it
shares the actor's bundles instead (actor, critic and engines time-share them, as in slime), each
training process then taking half of the training share. ``Placement.for_critic()`` is the
critic group's view (``rl_plugin.ray.critic_group.make_critic_group``). Bundles the cluster can never hold (more GPUs or
CPUs than it has, a bundle larger than any node) are refused before Ray is asked, in seconds,
naming the ask, the nodes and the flags that change it (``rl_plugin.ray.capacity``); a multi-GPU
vLLM engine on CPU bundles is refused there too (``configs.engine.check_engine_device``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_plugin.checkpoint.disk_space import parameter_count
from rl_plugin.configs.colocation import DISTRIBUTED_TRANSPORTS, refuse_colocated_nccl
from rl_plugin.configs.engine import check_engine_device
from rl_plugin.configs.run import RunConfig
from rl_plugin.errors import EXIT_SIGNALS, LoopError  # the exit signals are blocked in the local cluster
from rl_plugin.ray.bundle_order import (
    BundleSite,
    alive_nodes_with,
    bundle_sites,
    check_groups_within_nodes,
    check_node_count,
    sorted_sites,
)
from rl_plugin.ray.capacity import check_bundles_fit, placement_timeout_error
from rl_plugin.ray.reaper import Reaper, children, start_reaper
from rl_plugin.threads import ThreadPlan, is_small_model

PLACEMENT_TIMEOUT_S = 300.0  # resources the cluster has but other jobs hold: how long to wait for them
COLOCATED_TRAIN_SHARE = 0.75  # of a bundle's GPU/CPU for the training actor when colocated


def local_machine_has_cuda() -> bool:
    """The driver's own machine (the local cluster's only node when ``RAY_ADDRESS`` is unset)."""
    import torch

    return torch.cuda.is_available()


def placement_uses_gpus(device: str, cluster_gpus: float) -> bool:
    """GPU bundles or CPU bundles: ``--placement-device`` ``gpu`` / ``cpu``, or ``auto``: GPU
    bundles when the cluster has GPUs (``cluster_gpus``: ``ray.cluster_resources()["GPU"]``)."""
    if device == "cpu":
        return False
    if device == "gpu" and cluster_gpus <= 0:
        raise LoopError(
            "--placement-device gpu: the Ray cluster has no GPUs (ray.cluster_resources() lists none). Fix: "
            "start the GPU nodes' Ray with their GPUs (`ray start --num-gpus N`), or use --placement-device "
            "auto / cpu"
        )
    if device not in ("auto", "gpu"):
        raise ValueError(f"--placement-device {device!r}: one of auto, gpu, cpu")
    return cluster_gpus > 0


def init_ray(num_cpus: int) -> bool:
    """Join ``RAY_ADDRESS`` if set, else start a local cluster with ``num_cpus`` logical CPUs.
    Returns False when Ray was already initialised by the caller (who then owns its shutdown)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        check_ray_address(address)
        try:
            with _callers_sigterm_handler():
                ray.init(address=address, log_to_driver=True)
        except (ConnectionError, TimeoutError, RuntimeError) as exc:
            raise LoopError(
                f"RAY_ADDRESS={address}: cannot join the Ray cluster there ({type(exc).__name__}: {exc}). Fix: start the "
                "cluster first (`ray start --head`), point RAY_ADDRESS at its GCS address (host:6379), or unset RAY_ADDRESS "
                "to let the run start a local cluster"
            ) from None
    else:
        # CPU runs move tiny weights: a small object store. With GPUs, Ray's default (a share of
        # RAM) holds a full weight export, which travels through the object store at every sync.
        store = None if local_machine_has_cuda() else 512 * 1024 * 1024
        global _REAPER
        before = set(children(os.getpid()))
        # The cluster's processes start with the exit signals blocked (a child inherits the signal
        # mask): a SIGTERM to the whole process group (a scheduler's preemption) reaches the driver,
        # which saves through the still-running cluster, then tears it down (ray.shutdown, and the
        # reaper's SIGKILL for what is left); the driver's own mask comes back right after.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, EXIT_SIGNALS)
        try:
            _REAPER = start_reaper()  # before ray.init(): a driver killed during start-up takes the cluster down too
            with _callers_sigterm_handler():
                ray.init(
                    address="local",  # a cluster of its own even when another runs on the node (see the docstring)
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    log_to_driver=True,
                    object_store_memory=store,
                )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if _REAPER is not None:
            _REAPER.set_heads(
                sorted(set(children(os.getpid())) - before - {_REAPER.proc.pid})
            )  # the cluster's head processes
    return True


_REAPER: Optional[Reaper] = None


@contextlib.contextmanager
def _callers_sigterm_handler():
    """``ray.init`` installs SIGTERM handlers in the driver that exit at once (``sys.exit``), and
    a SIGTERM that lands during it would run them; the loop has its own (save, then stop:
    ``rl_plugin.loop.exit_request``), so Ray's installer is a no-op for the duration and the
    caller's handler stays. The local cluster is still taken down at exit (``shutdown_ray``, the
    reaper)."""
    from ray._private import utils as ray_utils

    install = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install


CONNECT_TIMEOUT_S = 20.0  # RL_PLUGIN_RAY_CONNECT_TIMEOUT: how long a RAY_ADDRESS may take to answer


def check_ray_address(address: str, timeout: Optional[float] = None) -> None:
    """Fail in seconds, naming ``RAY_ADDRESS``, when nothing answers at its ``host:port``
    (``ray.init`` would wait for ever on a port where nothing listens). ``auto`` and Ray Client's
    ``ray://`` addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LoopError(
            f"RAY_ADDRESS={address}: not a host:port address. Fix: set it to the head node's GCS address, e.g. "
            "10.0.0.1:6379, or unset it to let the run start a local cluster"
        )
    timeout = float(os.environ.get("RL_PLUGIN_RAY_CONNECT_TIMEOUT", CONNECT_TIMEOUT_S)) if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LoopError(
                    f"RAY_ADDRESS={address}: nothing answered there within {timeout:g} s ({exc}). Fix: start the "
                    "cluster first (`ray start --head` on that host), check the host and port (the head's GCS, "
                    "6379 by default) and the firewall, or unset RAY_ADDRESS to let the run start a local cluster"
                ) from None
            time.sleep(0.5)


def shutdown_ray() -> None:
    global _REAPER
    if ray.is_initialized():
        ray.shutdown()
    if _REAPER is not None:
        _REAPER.stop()  # kills whatever of the local cluster outlived ray.shutdown()
        _REAPER = None


def num_engines(run: RunConfig) -> int:
    """``--rollout-num-gpus / --rollout-num-gpus-per-engine`` (slime's rule); one by default.
    Colocated server engines (vllm, sglang) take every training GPU: world / per-engine."""
    per_engine = run.rollout.engine.tensor_parallel_size
    if run.cluster.colocate and run.rollout.engine.engine != "hf":
        return max(1, run.cluster.world_size // per_engine)
    return max(1, (run.cluster.rollout_num_gpus or per_engine) // per_engine)


def engine_processes(run: RunConfig) -> int:
    """Engine actors to start: 0 when the single ``hf`` engine lives in the manager."""
    n = num_engines(run)
    return 0 if (run.rollout.engine.engine == "hf" and n == 1) else n


@dataclass
class Placement:
    pg: Any
    world_size: int
    gpus: bool
    colocate: bool
    rollout_bundle: int
    engine_bundles: List[int] = field(default_factory=list)
    gpus_per_engine: int = 1
    train_bundles: List[int] = field(default_factory=list)  # rank r's bundle; empty: bundle r
    engine_devices: List[str] = field(default_factory=list)  # colocated TP engines: CUDA_VISIBLE_DEVICES each
    train_sites: List[BundleSite] = field(default_factory=list)  # in rank order
    threads: ThreadPlan = field(default_factory=ThreadPlan.default)  # each role's torch threads
    critic_bundles: List[int] = field(default_factory=list)  # critic rank r's bundle; empty: no critic
    critic_sites: List[BundleSite] = field(default_factory=list)  # in critic rank order

    def for_critic(self) -> "Placement":
        """The critic group's view: its ranks on ``critic_bundles`` (its own, or the actor's when
        colocated), for ``TrainGroup(run.critic_train, placement.for_critic())``."""
        if not self.critic_bundles:
            raise ValueError("this placement holds no critic (the run is not --advantage-estimator ppo)")
        return replace(
            self, world_size=len(self.critic_bundles), train_bundles=self.critic_bundles, train_sites=self.critic_sites
        )

    @property
    def train_share(self) -> float:
        """A training process's share of its bundle: all of it disaggregated; colocated,
        ``COLOCATED_TRAIN_SHARE``, halved when the critic's process shares the bundle too."""
        if not self.colocate:
            return 1.0
        return COLOCATED_TRAIN_SHARE / (2 if self.critic_bundles else 1)

    @property
    def num_engines(self) -> int:
        return len(self.engine_bundles)

    def train_options(self, rank: int) -> Dict[str, Any]:
        share = self.train_share
        opts = dict(num_cpus=share, num_gpus=share if self.gpus else 0)
        bundle = self.train_bundles[rank] if self.train_bundles else rank
        return {
            **opts,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
        }

    def rollout_options(self, rollout_num_gpus: int) -> Dict[str, Any]:
        if self.colocate:  # halved when engine actors share the bundle too (see engine_options)
            share = (1.0 - COLOCATED_TRAIN_SHARE) / (2 if self.engine_bundles else 1)
            opts = dict(num_cpus=share, num_gpus=share if self.gpus else 0)
        else:
            opts = dict(num_cpus=1, num_gpus=rollout_num_gpus if self.gpus and not self.engine_bundles else 0)
        return {
            **opts,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.rollout_bundle
            ),
        }

    def engine_options(self, i: int) -> Dict[str, Any]:
        if self.colocate:
            share = (1.0 - COLOCATED_TRAIN_SHARE) / 2  # beside the manager's share of the bundle
            opts = dict(num_cpus=share, num_gpus=share if self.gpus else 0)
            if self.engine_devices:  # tensor-parallel over its ranks' GPUs, not only its bundle's
                env = {
                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                    "CUDA_VISIBLE_DEVICES": self.engine_devices[i],
                }
                opts["runtime_env"] = {"env_vars": env}
        else:
            opts = dict(num_cpus=1, num_gpus=self.gpus_per_engine if self.gpus else 0)
        return {
            **opts,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.engine_bundles[i]
            ),
        }

    def remove(self) -> None:
        remove_placement_group(self.pg)


def own_critic_ranks(run: RunConfig) -> int:
    """The critic's ranks on bundles of their own: its world disaggregated; 0 colocated (it shares
    the actor's) or without a critic."""
    return run.critic.world_size(run) if run.critic.enabled and not run.cluster.colocate else 0


def required_cpus(run: RunConfig) -> int:
    extra = 0 if run.cluster.colocate else 1 + engine_processes(run) + own_critic_ranks(run)
    return run.cluster.world_size + extra


def create_placement(run: RunConfig) -> Placement:
    cluster, per_engine = run.cluster, run.rollout.engine.tensor_parallel_size
    gpus = placement_uses_gpus(cluster.placement_device, ray.cluster_resources().get("GPU", 0))
    check_engine_device(
        run.rollout.engine.engine,
        per_engine,
        gpus,
        f"--placement-device {cluster.placement_device} on a Ray cluster with {'' if gpus else 'no '}GPUs",
    )
    if cluster.colocate and gpus and run.sync.transport in DISTRIBUTED_TRANSPORTS:
        refuse_colocated_nccl(run.sync.transport)
    device = "GPU" if gpus else "CPU"
    alive = alive_nodes_with(device)
    check_node_count(cluster.actor_num_nodes, alive, device)
    if run.critic.enabled:
        check_node_count(run.critic.num_nodes(run), alive, device, role="critic")
    world = cluster.world_size
    bundles: List[Dict[str, float]] = [{"CPU": 1, "GPU": 1} if gpus else {"CPU": 1} for _ in range(world)]
    rollout_bundle, engines = 0, engine_processes(run)
    engine_bundles = [i % world for i in range(engines)]
    if not cluster.colocate:
        n = cluster.rollout_num_gpus or per_engine
        bundles.append({"CPU": 1, "GPU": n} if gpus and not engines else {"CPU": 1})
        rollout_bundle = world
        engine_bundles = list(range(world + 1, world + 1 + engines))
        bundles += [{"CPU": 1, "GPU": per_engine} if gpus else {"CPU": 1} for _ in range(engines)]
    critic_bundles = list(range(len(bundles), len(bundles) + own_critic_ranks(run)))  # after the others'
    bundles += [{"CPU": 1, "GPU": 1} if gpus else {"CPU": 1} for _ in critic_bundles]
    check_bundles_fit(run, bundles, ray.nodes(), world, engines, gpus)  # never fits: fail now, not after the wait
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise placement_timeout_error(
            run, bundles, ray.available_resources(), PLACEMENT_TIMEOUT_S, world, engines, gpus
        ) from None
    try:
        train_sites = sorted_sites(bundle_sites(pg, range(world), [1 if gpus else 0] * world))
        model = run.train.model
        group = model.tensor_model_parallel_size * model.context_parallel_size
        check_groups_within_nodes(train_sites, group, "a TP x CP")
        train_bundles = [s.bundle for s in train_sites]
        engine_devices: List[str] = []
        if cluster.colocate:  # engine i: the bundle of rank i x per_engine, and with N GPUs the next N ranks' GPUs
            rollout_bundle = train_bundles[0]
            engine_bundles = [train_bundles[(i * per_engine) % world] for i in range(engines)]
            if gpus and per_engine > 1:
                check_groups_within_nodes(train_sites, per_engine, "a colocated engine's tensor-parallel")
                engine_devices = [
                    ",".join(str(g) for s in train_sites[i * per_engine : (i + 1) * per_engine] for g in s.gpu_ids)
                    for i in range(engines)
                ]
        elif engine_bundles:
            sites = bundle_sites(pg, engine_bundles, [per_engine if gpus else 0] * len(engine_bundles))
            engine_bundles = [s.bundle for s in sorted_sites(sites)]
        critic_sites: List[BundleSite] = []
        if run.critic.enabled:  # its own bundles in (node, GPU id) order, or colocated the actor's
            critic_sites = train_sites if cluster.colocate else critic_order(pg, critic_bundles, gpus, group)
        critic_bundles = [s.bundle for s in critic_sites]
        threads = thread_plan(run, pg, train_bundles + critic_bundles, rollout_bundle, engine_bundles, gpus)
    except BaseException:
        remove_placement_group(pg)
        raise
    return Placement(
        pg,
        world,
        gpus,
        bool(cluster.colocate),
        rollout_bundle,
        engine_bundles,
        per_engine,
        train_bundles=train_bundles,
        train_sites=train_sites,
        engine_devices=engine_devices,
        threads=threads,
        critic_bundles=critic_bundles,
        critic_sites=critic_sites,
    )


def critic_order(pg, bundles: List[int], gpus: bool, group: int) -> List[BundleSite]:
    """The critic's own ``bundles`` of ``pg`` in rank order (node, GPU id), each TP x CP group of
    its ranks (``group``: the actor's TP x CP) on one node."""
    sites = sorted_sites(bundle_sites(pg, bundles, [1 if gpus else 0] * len(bundles)))
    check_groups_within_nodes(sites, group, "the critic's TP x CP", role="critic")
    return sites


def thread_plan(run: RunConfig, pg, train_bundles, rollout_bundle: int, engine_bundles, gpus: bool) -> ThreadPlan:
    """Each role's torch threads (``rl_plugin.threads``) from the bundles' nodes (``train_bundles``:
    one per training process, the critic's included, twice a bundle both share) and the mode:
    training and generation at once when it generates ahead (overlapped, fully async; never
    colocated); the manager generates only with the ``hf`` engine in it; SFT generates nothing."""
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    generates = run.mode.generates
    checkpoint = run.train.model.hf_checkpoint
    return ThreadPlan.for_placement(
        train_nodes=[node_of[b] for b in train_bundles],
        rollout_node=None if not generates or engine_bundles else node_of[rollout_bundle],
        engine_nodes=[node_of[b] for b in engine_bundles] if generates else [],
        concurrent=not run.cluster.colocate and run.mode.generates_ahead,  # SFT: nothing to share with
        single=gpus or is_small_model(parameter_count(checkpoint) if checkpoint else None),
        deterministic=run.true_on_policy.deterministic,
    )
