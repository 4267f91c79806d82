"""The training group: one ``TrainActor`` per rank, called in lock step, failures named.

``TrainGroup`` is the loop's typed proxy of the ranks: one method per ``TrainActor`` method the
loop calls (``train_rollout``, ``export_weight_buckets``, ``plan_docs_steps``, ``eval_nll``,
``offload_train``, ``save``, ``load``; a critic group's ``compute_values`` and
``train_values_rollout``, and the actor's ``log_probs`` for PPO's KL penalty), each naming the actor's method it submits, taking what
every rank receives (one value for all, or one per rank: ``per_rank[r]`` goes to rank r) and
returning every rank's answer in rank order. The ``submit_*`` variants return an ``InFlight``
(the ranks' ObjectRefs, waited for later) so the driver can overlap the call with another.

A wait stops at the first failure: if an actor process dies (killed, OOM, segfault) or raises, it
raises ``TrainActorError`` naming the rank, its pid and node, and Ray's cause, instead of leaving
the surviving ranks blocked in a collective. The driver then tears the group down; checkpoints
already written stay, so ``--load`` resumes.

Waits never block in ``ray.get``: they poll every ``POLL_S`` and call ``poll`` in between (the
run's exit request, ``rl_plugin.loop.exit_request``: it may stop the ranks with
``request_stop``, or raise). ``request_stop`` reaches a rank while it trains, on the actor's
``control`` thread (``rl_plugin.ray.train_actor``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

import ray
import torch

from rl_plugin.configs import TrainConfig
from rl_plugin.loss import StepBatch
from rl_plugin.ray.cluster import Placement
from rl_plugin.ray.engine_actor import CONTROL_GROUP
from rl_plugin.ray.rollout_actor import error_line
from rl_plugin.ray.testing_hooks import forwarded_env
from rl_plugin.ray.train_actor import TrainActor, TrainedRollout
from rl_plugin.step_plan import RankPlan

DEATH_GRACE_S = 30.0
POLL_S = 0.2  # a wait's ray.wait timeout, between two calls of ``poll``

T = TypeVar("T")


class TrainActorError(RuntimeError):
    def __init__(
        self,
        rank: int,
        method: str,
        cause: str,
        *,
        died: bool,
        info: Optional[Dict[str, Any]] = None,
        error_line: Optional[str] = None,
    ):
        self.rank, self.method, self.died = rank, method, died
        self.error_line = error_line  # the remote ``SomeError: message`` line of a raised error
        where = f" (pid {info['pid']}, node {info['ip']})" if info else ""
        what = "died" if died else "raised"
        super().__init__(f"train actor rank {rank}{where} {what} during {method}: {cause}")


class InFlight(Generic[T]):
    """A ``TrainActor`` method submitted on every rank and not waited for yet: ``refs[r]`` is rank
    r's answer (an ObjectRef, which may be handed to another actor as it is); ``wait()`` returns
    the answers in rank order, a failed rank named (``TrainGroup.wait``)."""

    def __init__(self, group: "TrainGroup", method: str, refs: List[ray.ObjectRef]):
        self.group, self.method, self.refs = group, method, refs

    def wait(self) -> List[T]:
        return self.group.wait(self.refs, self.method)


class TrainGroup:
    def __init__(self, config: TrainConfig, placement: Placement):
        """``config``: the run config's ``TrainConfig``, which every rank receives."""
        self.world_size = placement.world_size
        self.poll: Callable[[], None] = lambda: None  # the run's exit request, between two waits
        remote_cls = ray.remote(concurrency_groups=CONTROL_GROUP)(TrainActor)  # request_stop while training
        env = forwarded_env()  # the tests' hooks and the threads, even to a cluster older than this run
        opts = {"runtime_env": {"env_vars": env}} if env else {}
        self.actors = [
            remote_cls.options(**placement.train_options(r), **opts, max_restarts=0).remote(
                r, self.world_size, placement.threads.train
            )
            for r in range(self.world_size)
        ]
        addrs = self._wait([a.address.remote() for a in self.actors], "address")
        self.info: List[Dict[str, Any]] = [{"ip": ip, "pid": pid} for ip, _, pid in addrs]
        master_addr, master_port, _ = addrs[0]
        layout = self._submit(TrainActor.init, [(master_addr, master_port, config)] * self.world_size).wait()
        for i, lay in zip(self.info, layout):
            i.update(lay)
        self.dp_size = layout[0]["dp_size"]

    def dp_rank(self, rank: int) -> int:
        return self.info[rank]["dp_rank"]

    def rendezvous_address(self) -> Tuple[str, int]:
        """Rank 0's node ip and the port of the distributed weight sync's store, which rank 0 hosts
        from now on (bound once and kept: ``TrainActor.weight_store_address``)."""
        return tuple(ray.get(self.actors[0].weight_store_address.remote()))

    # -- the ranks' methods (``TrainActor``), typed ----------------------------------------------
    def submit_train_rollout(self, plans: Sequence[RankPlan], publish=None) -> InFlight[TrainedRollout]:
        """``TrainActor.train_rollout``: rank r trains ``plans[r]`` (its share of the rollout's
        steps); given ``publish`` (a ``SyncRequest``, to every rank: the export is collective),
        rank 0 then publishes the weights after them. Not waited for."""
        return self._submit(TrainActor.train_rollout, [(plan, publish) for plan in plans])

    def train_rollout(self, plans: Sequence[RankPlan], publish=None) -> List[TrainedRollout]:
        """``submit_train_rollout``, waited for: every rank's ``(reports, handle)``."""
        return self.submit_train_rollout(plans, publish).wait()

    def submit_export_weight_buckets(self, request) -> InFlight[Optional[Any]]:
        """``TrainActor.export_weight_buckets(request)`` on every rank (collective): rank 0's
        answer is the ``SyncHandle`` of the weights it published, the others' None. Not waited for."""
        return self._submit(TrainActor.export_weight_buckets, [(request,)] * self.world_size)

    def plan_docs_steps(self, shares: Sequence[StepBatch], num_groups: int) -> List[RankPlan]:
        """``TrainActor.plan_docs_steps``: rank r plans its DP share ``shares[r]`` of a rollout of
        ``num_groups`` prompt groups (collective over DP); its ``RankPlan``."""
        return self._submit(TrainActor.plan_docs_steps, [(share, num_groups) for share in shares]).wait()

    def eval_nll(self, batches: Sequence[StepBatch]) -> List[Tuple[float, float]]:
        """``TrainActor.eval_nll``: rank r scores ``batches[r]``; its ``(NLL sum, token count)``."""
        return self._submit(TrainActor.eval_nll, [(batch,) for batch in batches]).wait()

    def submit_compute_values(self, batches: Sequence[StepBatch]) -> InFlight[torch.Tensor]:
        """``TrainActor.compute_values``: the value model's forward on ``batches[r]`` on rank r (a
        critic group); each rank's ``[sum R_i]`` values. Not waited for."""
        return self._submit(TrainActor.compute_values, [(batch,) for batch in batches])

    def submit_log_probs(self, batches: Sequence[StepBatch], role: str) -> InFlight[torch.Tensor]:
        """``TrainActor.log_probs``: ``role``'s log-probs of ``batches[r]`` on rank r. Not waited for."""
        return self._submit(TrainActor.log_probs, [(batch, role) for batch in batches])

    def submit_train_values_rollout(
        self, plans: Sequence[RankPlan], value_clip: float
    ) -> InFlight[List[Dict[str, Any]]]:
        """``TrainActor.train_values_rollout``: rank r runs the value steps of ``plans[r]`` (a
        critic group) clipped at ``value_clip``; each rank's step reports (``critic/*``). Not waited for."""
        return self._submit(TrainActor.train_values_rollout, [(plan, value_clip) for plan in plans])

    def offload_train(self) -> List[int]:
        """``TrainActor.offload_train`` on every rank: the bytes each moved to host memory."""
        return self._submit(TrainActor.offload_train, [()] * self.world_size).wait()

    def save(self, path: str, step: int, extra: Dict[str, Any]) -> List[List[str]]:
        """``TrainActor.save`` on every rank into ``path``: the files each wrote (relative)."""
        return self._submit(TrainActor.save, [(path, step, extra)] * self.world_size).wait()

    def save_hf(self) -> List[None]:
        """``TrainActor.save_hf`` on every rank (collective: the export gathers): the Hugging Face
        directory of ``--save-hf`` / ``--save-hf-merged``, written by rank 0."""
        return self._submit(TrainActor.save_hf, [()] * self.world_size).wait()

    def load(self, path: str) -> List[Dict[str, Any]]:
        """``TrainActor.load`` of step directory ``path`` on every rank: each rank's metadata."""
        return self._submit(TrainActor.load, [(path,)] * self.world_size).wait()

    def _submit(self, method: Callable, per_rank_args: Sequence[tuple]) -> InFlight:
        """``method`` (a ``TrainActor`` function) submitted on rank r with ``per_rank_args[r]``."""
        name = method.__name__
        refs = [getattr(a, name).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return InFlight(self, name, refs)

    def wait(self, refs: List[ray.ObjectRef], method: str, *, first_rank: int = 0) -> List[Any]:
        """Results of ``refs`` (ranks ``first_rank``, ``first_rank + 1``, ...), failures named."""
        return self._wait(refs, method, first_rank=first_rank)

    def request_stop(self) -> None:
        """Every rank stops its train call before its next optimizer step (they agree on it)."""
        for a in self.actors:
            a.request_stop.options(concurrency_group="control").remote()

    def _wait(self, refs: List[ray.ObjectRef], method: str, *, first_rank: int = 0) -> List[Any]:
        rank_of = {ref: first_rank + r for r, ref in enumerate(refs)}
        results: Dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            if not ready:
                self.poll()
                continue
            for ref in ready:
                try:
                    results[rank_of[ref]] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                    raise self._root_cause(rank_of, ref, exc, pending, method) from None
        return [results[first_rank + r] for r in range(len(refs))]

    def _root_cause(self, rank_of, ref, exc, pending, method: str) -> "TrainActorError":
        """The error to report. When a rank dies, its peers usually fail first with a gloo/NCCL
        "connection reset"; so on a raised error, give the other ranks a grace period and
        report a dead actor if there is one (the raised error is kept in the message)."""
        rank = rank_of[ref]
        if isinstance(exc, ray.exceptions.RayActorError):
            cause = _cause(exc)
            if "creation task" in cause:  # __init__ raised (e.g. a GPU bundle without CUDA): its error line
                cause = f"{cause} -> {error_line(exc)}"
            return TrainActorError(rank, method, cause, died=True, info=self._info(rank))
        raised = TrainActorError(rank, method, str(exc), died=False, info=self._info(rank), error_line=error_line(exc))
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEATH_GRACE_S) if pending else ([], [])
        for other in ready:
            try:
                ray.get(other)
            except ray.exceptions.RayActorError as dead:
                r = rank_of[other]
                return TrainActorError(
                    r,
                    method,
                    f"{_cause(dead)} [rank {rank} then failed: {_first_line(exc)}]",
                    died=True,
                    info=self._info(r),
                )
            except ray.exceptions.RayTaskError:
                continue
        return raised

    def _info(self, rank: int) -> Optional[Dict[str, Any]]:
        info = getattr(self, "info", None)
        return info[rank] if info and rank < len(info) else None

    def kill(self) -> None:
        """Unlink rank 0's weight segment (if it still answers), then kill every rank; a dead rank
        0's segments are swept on its node by a task placed there (it may be another machine than
        the driver's, where the run's reaper does not reach)."""
        closed = True
        try:
            ray.get(self.actors[0].close_weight_sync.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a dead rank 0: swept below
            closed = False
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort on teardown; the actor may be gone
                pass
        info = self._info(0)
        if not closed and info and info.get("node_id") not in (None, "local"):
            sweep_node_segments(info["node_id"], [info["pid"]])


@ray.remote(num_cpus=0)
def _sweep_segments(pids: List[int]) -> List[str]:
    from rl_plugin.weight_sync.segment import sweep_stale

    return [str(p) for p in sweep_stale(dead_pids=pids)]


def sweep_node_segments(node_id: str, pids: List[int], timeout: float = 30.0) -> List[str]:
    """Unlink, on Ray node ``node_id``, the weight segments the (dead) processes ``pids`` created;
    returns the removed paths (best effort: [] when the node does not answer)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        task = _sweep_segments.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        return ray.get(task.remote(list(pids)), timeout=timeout)
    except Exception:  # noqa: BLE001 - a lost node: its segments go with its /dev/shm (or the next run's sweep)
        return []


def _first_line(exc: Exception) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(exc).__name__


def _cause(exc: Exception) -> str:
    """Ray's death cause: its first line plus the "dead because" / worker-exit lines (exit type
    and detail: killed, OOM, segfault, connection lost), without Ray's generic advice."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    keep = lines[:1] + [
        ln for ln in lines[1:] if "dead because" in ln or "exit type" in ln.lower() or "exit detail" in ln.lower()
    ]
    text = " ".join(keep)
    cut = text.find(" Some common causes")
    return text[:cut] if cut > 0 else text[:600]
