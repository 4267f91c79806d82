"""One training rank as a Ray actor: joins the torch.distributed group and drives its backend.

The actor is a thin shell around ``rl_plugin.backends.base.TrainBackend``: the driver calls the
same method on every rank (collectives inside the backend need all of them) and reads rank 0's
answer (the driver's typed proxy is ``rl_plugin.ray.train_group.TrainGroup``). ``train_rollout``
runs one rollout's optimizer steps: old (and reference) log-probs for all of this rank's samples
first, on the weights that generated them, then the steps in order. When the rollout is ONE
optimizer step, the old log-probs are that step's own detached training log-probs and the
separate forward is skipped (``rl_plugin.loss.runner.old_log_probs_rule``: same numbers, bit for
bit; the rule lists where the separate pass stays). Given ``publish`` (a ``SyncRequest``), the
same call then exports the new weights (collective) and rank 0 publishes them for the engines, so
the weight sync costs the loop no round trip of its own; without it nothing is exported.

Stopping (an exit signal): ``request_stop`` runs on the actor's ``control`` thread while a train
call runs on its own (a threaded actor whose default group stays one thread, so every torch,
CUDA and collective call stays on one thread as before). The train call reads the request before
each optimizer step; the ranks agree on it with one all-reduce (a rank that stopped alone would
leave the others in a collective), and stop together: the call returns the reports of the steps
done, and the export is skipped.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from rl_plugin.backends.offload import HostOffload
from rl_plugin.configs import TrainConfig
from rl_plugin.errors import WeightSyncError
from rl_plugin.loss import StepBatch, old_log_probs_rule
from rl_plugin.ray.gpu_check import require_cuda
from rl_plugin.ray.testing_hooks import TrainActorHooks
from rl_plugin.registries import TRAIN_BACKENDS
from rl_plugin.step_plan import RankPlan, plan_docs_steps
from rl_plugin.threads import TRAIN_THREADS_ENV, ThreadShare
from rl_plugin.weight_sync import node_id


class TrainedRollout(NamedTuple):
    """One rank's answer to ``TrainActor.train_rollout``."""

    reports: List[Dict[str, Any]]  # one per optimizer step done (fewer than planned: a stop was requested)
    handle: Optional[Any]  # rank 0's ``SyncHandle`` when ``publish`` was given and every step ran; else None


def backend_class(name: str):
    """The ``TrainBackend`` class ``--train-backend name`` names (``rl_plugin.registries.TRAIN_BACKENDS``)."""
    return TRAIN_BACKENDS.get(name)


class TrainActor:
    def __init__(self, rank: int, world_size: int, threads: Optional[ThreadShare] = None):
        require_cuda(f"train rank {rank}")  # a GPU bundle without CUDA: fail here, not train on gloo
        self.rank, self.world_size = rank, world_size
        self.backend = None
        self.publisher = None  # the weight sync's rank-0 side, made at the first export
        self._pg_store = None  # rank 0: the process group's TCPStore, hosted by ``address``
        self._weight_store_port: Optional[int] = None  # rank 0: the weight sync's store (``weight_store_address``)
        self.offload = HostOffload()  # --offload-train: the state in host memory while the engines generate
        self.step = 0
        self.fuse_old_log_probs = True  # False: always the separate pass (tests, benchmarks)
        self.stream_export = True  # False: every rank materialises the whole export (benchmarks)
        self._stop = threading.Event()  # set by request_stop (an exit signal); read before each step
        self.hooks = TrainActorHooks.from_env()  # the tests' fault injection (``ray/testing_hooks.py``)
        # the node's cores shared with the run's other processes (``rl_plugin.threads``; 1 without a plan)
        (threads or ThreadShare(TRAIN_THREADS_ENV)).apply()

    def address(self) -> Tuple[str, int, int]:
        """(node ip, port, pid): rank 0's ip and port become the rendezvous point. Rank 0 hosts the
        process group's store now, on a port the kernel picks and the store keeps (bound once: no
        free-port probe released and bound again later, which another process could take in
        between); the other ranks answer port 0."""
        import ray

        port = 0
        if self.rank == 0 and self._pg_store is None:
            from torch.distributed import TCPStore
            from torch.distributed.constants import default_pg_timeout

            self._pg_store = TCPStore(
                "0.0.0.0", 0, self.world_size, is_master=True, timeout=default_pg_timeout, wait_for_workers=False
            )
        if self._pg_store is not None:
            port = self._pg_store.port
        return ray.util.get_node_ip_address(), port, os.getpid()

    def weight_store_address(self) -> Tuple[str, int]:
        """Rank 0's (node ip, port) of the distributed weight sync's store: hosted here once
        (``weight_sync.distributed.host_store``: bound and kept, never a probed free port)."""
        import ray

        from rl_plugin.weight_sync.distributed import host_store

        if self._weight_store_port is None:
            self._weight_store_port = host_store()
        return ray.util.get_node_ip_address(), self._weight_store_port

    def init(self, master_addr: str, master_port: int, config: TrainConfig) -> Dict[str, int]:
        import torch.distributed as dist
        from torch.distributed import TCPStore
        from torch.distributed.constants import default_pg_timeout

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0
        # rank 0 hosts the store ``address`` bound (a caller that chose its own port: hosted here now)
        store = self._pg_store or TCPStore(
            master_addr,
            master_port,
            self.world_size,
            is_master=self.rank == 0,
            timeout=default_pg_timeout,
            wait_for_workers=False,
        )
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
        self.config = config
        self.backend = backend_class(config.train_backend).from_config(config)
        ps = self.backend.parallel_state
        return {
            "dp_rank": ps.dp_rank,
            "dp_size": ps.dp_size,
            "tp_rank": ps.tp_rank,
            "cp_rank": ps.cp_rank,
            "pid": os.getpid(),
            "node_id": node_id(),  # where rank 0's weight segments live (swept there if it dies)
        }

    # -- training -----------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop the train call in progress before its next optimizer step (module docstring)."""
        self._stop.set()

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop: every rank calls this at the same point."""
        if self.world_size == 1:
            return self._stop.is_set()
        import torch.distributed as dist

        flag = torch.tensor([float(self._stop.is_set())], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def train_rollout(self, plan: RankPlan, publish=None) -> TrainedRollout:
        """The rollout's steps (``_train_steps``), then, given ``publish`` (a ``SyncRequest``), the
        export and publish of the weights after them (``export_weight_buckets``; every rank must
        be given it: the export is collective). No export when ``publish`` is None or when a stop
        request cut the steps (the same on every rank: agreed)."""
        reports = self._train_steps(plan)
        stopped = len(reports) < len(plan.step_bounds)
        handle = self.export_weight_buckets(publish) if publish is not None and not stopped else None
        return TrainedRollout(reports, handle)

    def _train_steps(self, plan: RankPlan) -> List[Dict[str, Any]]:
        """Old/ref log-probs for ``plan.batch`` (this rank's samples of the rollout), then one
        ``train_step`` per step of the plan (``rl_plugin.step_plan.RankPlan``); fewer reports
        than steps when a stop was requested (module docstring)."""
        from rl_plugin.phases import record

        self._onload()
        record(f"train{self.rank}.train")
        batch = plan.batch
        t0 = time.perf_counter()
        old_from_forward = False
        if self.config.loss.is_sft:  # the NLL needs no old / reference log-probs
            batch.old_log_probs = None
        elif self.config.use_rollout_logprobs:  # slime: the engine's log-probs are the old policy's
            if batch.rollout_log_probs is None:
                raise ValueError("--use-rollout-logprobs: the rollout carries no engine log-probs")
            batch.old_log_probs = batch.rollout_log_probs.clone()
        elif self.separate_old_pass_reason(plan) is None:
            batch.old_log_probs = None  # the step's own forward provides them (no redundant forward)
            old_from_forward = True
        else:
            batch.old_log_probs = self.backend.compute_log_probs(batch, role="actor")
        if self.config.loss.use_kl_loss and not self.config.loss.is_sft:
            batch.ref_log_probs = self.backend.compute_log_probs(batch, role="ref")
        if self.config.loss.use_opd and batch.teacher_log_probs is None:  # --opd-type megatron: the teacher is here
            batch.teacher_log_probs = self.backend.compute_log_probs(batch, role="teacher")
        logprob_time = time.perf_counter() - t0
        reports = []
        for k, (sub, num_groups, micro_batches) in enumerate(plan.steps()):
            self.hooks.before_step(self.rank, self.step + 1, self._stop)
            if self._stop_agreed():  # an exit signal: the steps done are reported, the rest not run
                break
            t1 = time.perf_counter()
            kwargs = {} if micro_batches is None else {"micro_batches": micro_batches}
            if old_from_forward:
                kwargs["old_from_forward"] = True
            report = dict(self.backend.train_step(sub, num_groups=num_groups, **kwargs))
            self.step += 1
            report = {key: _plain(v) for key, v in report.items()}
            report["time/train_step"] = time.perf_counter() - t1
            report["time/log_probs"] = logprob_time if k == 0 else 0.0
            reports.append(report)
        return reports

    # -- the critic (``--advantage-estimator ppo``: a group built from ``run.critic_train``) -------
    def compute_values(self, batch: StepBatch) -> torch.Tensor:
        """The value model's forward on ``batch`` (this rank's share): ``[sum R_i]`` fp32 CPU,
        the "old" values of the rollout, before any update (``TrainBackend.compute_values``)."""
        self._onload()
        return self.backend.compute_values(batch)

    def log_probs(self, batch: StepBatch, role: str) -> torch.Tensor:
        """``role``'s (``actor`` / ``ref``) log-probs of ``batch``'s response tokens, forward only:
        the driver's per-token KL penalty of PPO's rewards (``--kl-coef``)."""
        self._onload()
        return self.backend.compute_log_probs(batch, role=role)

    def train_values_rollout(self, plan: RankPlan, value_clip: float) -> List[Dict[str, Any]]:
        """The value model's steps over the rollout's plan (the actor's step plan, this rank's
        share; ``plan.batch`` carries ``values`` and ``returns``): one ``value_train_step`` per
        step with the clip ``value_clip`` (``--value-clip``), each report's keys under ``critic/``. Not cut by a stop request:
        a rollout's value steps finish, so a checkpoint holds the actor and the critic of the same
        rollout (the loop trains the critic after the actor's call returned complete)."""
        from rl_plugin.phases import record

        self._onload()
        record(f"train{self.rank}.value_train")
        reports = []
        for sub, num_groups, micro_batches in plan.steps():
            t1 = time.perf_counter()
            kwargs = {} if micro_batches is None else {"micro_batches": micro_batches}
            report = self.backend.value_train_step(sub, num_groups=num_groups, value_clip=value_clip, **kwargs)
            self.step += 1
            out = {f"critic/{key}": _plain(v) for key, v in report.items()}
            out["time/critic_train_step"] = time.perf_counter() - t1
            reports.append(out)
        return reports

    def eval_nll(self, batch: StepBatch) -> Tuple[float, float]:
        """SFT's held-out loss on this rank's share: ``(sum_t m_t * -log p_t, sum_t m_t)``
        (a forward pass, no step)."""
        logp = self.backend.compute_log_probs(batch, role="actor")
        mask = batch.loss_mask.to(logp.dtype)
        return float(-(logp * mask).sum()), float(mask.sum())

    def separate_old_pass_reason(self, plan: RankPlan) -> Optional[str]:
        """Why this rollout needs its separate old-log-prob forward (None: the training forward's
        detached log-probs are the old ones, bit for bit; ``runner.old_log_probs_rule``)."""
        if not self.fuse_old_log_probs:
            return "disabled (fuse_old_log_probs = False)"
        return old_log_probs_rule(
            step_bounds=plan.step_bounds,
            num_samples=plan.batch.num_samples,
            cfg=self.backend.runner.cfg,
            ps=self.backend.parallel_state,
            has_rollout_log_probs=plan.batch.rollout_log_probs is not None,
            deterministic_forward=self.backend.deterministic_forward(),
        )

    def plan_docs_steps(self, batch: StepBatch, num_groups: int) -> RankPlan:
        """--docs-per-step: this rank's plan of its share ``batch`` (collective over DP), from the
        runner's micro-batches (the one planner)."""
        return plan_docs_steps(
            batch,
            self.backend.runner.plan(batch),
            num_groups=num_groups,
            docs_per_step=self.config.batching.docs_per_step,
            dp_group=self.backend.parallel_state.dp_group,
        )

    # -- colocation (--offload-train) ------------------------------------------------------------
    def offload_train(self) -> int:
        """The training state to host memory while the colocated engines generate
        (``backends/offload.py``); the next call that needs it (train, export, save, load)
        brings it back first. Returns the bytes moved (0: already offloaded)."""
        from rl_plugin.phases import record

        moved = self.offload.offload(self.backend.state_tensors(), torch.device(self.backend.loss_device))
        if moved:
            record(f"train{self.rank}.offload")
        return moved

    def _onload(self) -> None:
        if self.offload.reload() is not None:
            from rl_plugin.phases import record

            record(f"train{self.rank}.reload")

    # -- weights and checkpoints --------------------------------------------------------------
    def export_weight_buckets(self, request) -> Optional[Any]:
        """Collective export; rank 0 publishes it for the engines
        (``rl_plugin.weight_sync.WeightPublisher``: shared memory on its node, the object
        store for other nodes, only the tensors that changed) and returns the ``SyncHandle``;
        other ranks None. ``request``: a ``SyncRequest`` (buffer size, transport, engine nodes).

        Streamed (``stream_export``, the default): the backend's ``stream_hf_weights`` runs on
        every rank (only the ranks that must gather do work) and rank 0 publishes each tensor as
        it arrives (``publish_stream``), so no rank holds a second copy of the model. With
        ``stream_export = False``, or a backend without ``hf_weight_specs``, every rank
        materialises ``export_hf_state_dict`` first (the path before streaming; benchmarks).
        With LoRA the stream is ``stream_lora_adapters`` (canonical adapter names, always streamed):
        the engines keep the base and receive the adapters only."""
        from rl_plugin.weight_sync import WeightPublisher

        self._onload()
        t0 = time.perf_counter()
        lora = self.backend.lora_enabled  # LoRA: the adapters alone travel (the engine keeps the base)
        export = self.backend.stream_lora_adapters if lora else self.backend.stream_hf_weights
        # specs: local and cheap (meta tensors), the same answer on every rank, so all take one path
        if lora:
            specs = self.backend.lora_adapter_specs()
        else:
            specs = self.backend.hf_weight_specs() if self.stream_export else None
        streamed = specs is not None
        if not streamed:
            sd = self.backend.export_hf_state_dict()
        if self.rank != 0:
            if streamed:
                for _ in export():  # this rank's part of the gathers
                    pass
            return None
        if self.publisher is None:
            self.publisher = WeightPublisher(request.transport, skip=getattr(self.backend, "tied_names", ()))
        if not streamed:
            t1 = time.perf_counter()
            try:
                handle = self.publisher.publish(sd, request)
            except WeightSyncError as exc:
                return self._failed_sync(request, exc)
            handle.export_seconds = t1 - t0
            return handle
        # the distributed transport alone sends from the device: the export stays there (issue 37 item 8)
        stream = _Timed(export() if lora else self.backend.stream_hf_weights(host=self.publisher.host_tensors))
        try:
            handle = self.publisher.publish_stream(specs, stream, request)
        except Exception as exc:  # a publish error: finish the collectives so the other ranks are not left waiting
            for _ in stream:
                pass
            if isinstance(exc, WeightSyncError):  # distributed: an engine died or stalled mid-sync
                return self._failed_sync(request, exc)
            raise
        handle.export_seconds = stream.seconds
        handle.publish_seconds -= stream.seconds
        return handle

    def _failed_sync(self, request, exc: Exception) -> Any:
        """A sync the engines did not complete (``weight_sync.distributed``): the steps stand, the
        handle says why, and the driver replaces the engines (their weights are unknown)."""
        from rl_plugin.weight_sync import SyncHandle, node_id

        return SyncHandle(self.publisher.version, node_id(), request.buffer_bytes, error=str(exc))

    def close_weight_sync(self) -> None:
        """Unlink the weight segment (teardown; a killed process's segment is swept later)."""
        if self.publisher is not None:
            self.publisher.close()

    def save(self, path: str, step: int, extra: Dict[str, Any]) -> List[str]:
        """This rank's part of the checkpoint into ``path``; returns the files it wrote (relative)."""
        self._onload()
        return list(self.backend.save_checkpoint(path, step=step, extra=extra))

    def save_hf(self) -> None:
        """``--save-hf`` (and ``--save-hf-merged``) alone, at the end of a run without ``--save``:
        the final weights as a Hugging Face directory, no checkpoint; collective."""
        self._onload()
        self.backend.save_hf(self.config.model.save_hf)

    def load(self, path: str) -> Dict[str, Any]:
        self._onload()
        meta = self.backend.load_checkpoint(path)
        self.step = int(meta["step"])
        return meta

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _Timed:
    """An iterator that counts the seconds spent producing its items (the backend's export)."""

    def __init__(self, it):
        self.it, self.seconds = iter(it), 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.seconds += time.perf_counter() - t0


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v
