"""The driver of ``rl-plugin-train``: owns the Ray actors and runs rollout -> train -> sync.

The weight sync rides on the calls the loop makes anyway: the train call of rollout k exports
and publishes the new weights at its end (``TrainActor.train_rollout_and_sync``, rank 0's
``SyncHandle`` comes back with the reports), and the next rollout-manager call (generate, or
evaluate) loads that handle before it samples. Only the first sync of a run (or of a fresh
rollout manager) is a call of its own (``sync_weights``).

See ``rl_plugin.train`` for the loop. Before Ray starts, ``preflight`` checks everything that
needs no world and the driver takes the output directory's lock (``run_lock``). Failures end the
run with a ``LoopError`` naming what broke (e.g. which train actor died and why) and where to
resume from; Ctrl-C ends it with one line naming the last checkpoint and the ``--load`` command.
The metrics file keeps every line already written and the last complete checkpoint stays the
resume point; on resume, lines past the checkpoint's step are moved to ``*.superseded.jsonl``.

``--max-weight-staleness 1`` overlaps the two halves (``_overlapped_rollout``): generation of
rollout k+1 runs on the engine while the trainer trains on rollout k (which publishes the
weights after it), and the generate of rollout k+2 loads them first; a checkpoint then also holds
rollout k+1 (``pending_rollout``), so a resumed run trains on exactly what the uninterrupted one
would have.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import ray
import torch

from rl_plugin.arguments import validate_world
from rl_plugin.arguments.async_training import staleness_warning
from rl_plugin.arguments.rollout import validate_engine_installed
from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.loop.checkpoint import begin_save, commit_save, latest_step, move_checkpoints_aside, step_dir
from rl_plugin.loop.embedded import is_embedded, prepare_embedded
from rl_plugin.loop.logger import MetricsLogger, summary_line, supersede_after
from rl_plugin.loop.pending_rollout import PENDING_ROLLOUT, read_pending_rollout, write_pending_rollout
from rl_plugin.loop.plot import plot_reward_curve
from rl_plugin.loop.preflight import check_progress, finished_message, is_finished, preflight
from rl_plugin.loop.run_lock import RunLock
from rl_plugin.loop.steps import rollout_batch
from rl_plugin.ray.cluster import create_placement, init_ray, required_cpus, shutdown_ray
from rl_plugin.ray.rollout_actor import (
    RolloutSetupError,
    create_rollout_manager,
    error_line,
    fault_points,
    generate_ref,
)
from rl_plugin.ray.train_group import TrainActorError, TrainGroup
from rl_plugin.step_plan import plan_global_batch_steps, split_rollout_for_dp

ROLLOUT_STATS = ("reward_mean", "reward_max", "response_len_mean", "truncated_frac")
ROLLOUT_STAT_PREFIXES = ("dynamic_sampling/", "overlong/", "reward_shaped_mean")


class LoopError(RuntimeError):
    """The run stopped; the message says why and how to resume."""


class WeightSyncError(LoopError):
    pass


class Interrupted(LoopError):
    """Ctrl-C (SIGINT): the actors are torn down; the message names the resume command."""


def resume_command(argv: Sequence[str], load_dir: str) -> str:
    """The command line that resumes this run: ``argv`` with ``--load load_dir`` (replacing any
    ``--load`` and dropping ``--overwrite-save``)."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok == "--load":
            skip = True
            continue
        if tok.startswith("--load=") or tok == "--overwrite-save":
            continue
        out.append(tok)
    return shlex.join(["rl-plugin-train", *out, "--load", str(load_dir)])


def compare_fingerprints(trainer: Dict[str, str], rollout: Dict[str, str]) -> None:
    """Raise ``WeightSyncError`` naming the first tensor whose rollout copy differs."""
    for name in sorted(trainer):
        if name not in rollout:
            raise WeightSyncError(
                f"--check-weight-sync: the rollout engine has no tensor {name!r} that the trainer exports"
            )
        if rollout[name] != trainer[name]:
            raise WeightSyncError(
                f"--check-weight-sync: rollout weights differ from the trainer's at {name!r} "
                f"(sha256 {rollout[name][:12]} vs {trainer[name][:12]}): the weight sync is broken"
            )


def _keep_previous(metrics_file: Path) -> None:
    """A fresh (not resumed) run starts a new metrics file; an earlier run's files are renamed
    to ``*.prev<N>``, never deleted. A resumed run appends instead."""
    for path in (metrics_file, metrics_file.with_name(metrics_file.stem + ".timings.jsonl")):
        if path.exists() and path.stat().st_size > 0:
            n = 1
            while path.with_name(f"{path.name}.prev{n}").exists():
                n += 1
            path.rename(path.with_name(f"{path.name}.prev{n}"))
            print(f"{path} exists from an earlier run: kept as {path.name}.prev{n}", flush=True)


def _actor_died(exc: Exception) -> bool:
    """The rollout manager died (``RayActorError``), or one of its engine actors did while the
    manager waited on it (the manager's call then fails with the engine's ``RayActorError``)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return True
    return isinstance(getattr(exc, "cause", None), ray.exceptions.RayActorError)


class Driver:
    def __init__(self, args, argv: Optional[Sequence[str]] = None):
        self.args = args
        self.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command in messages
        self.group = None
        self.rollout = None
        self.engines = []
        self.last_sync = {"bytes": 0.0, "seconds": 0.0}  # the last load: bytes, the slowest engine's seconds
        self.engine_nodes = None  # the Ray node id of every engine of the current rollout manager
        self.engine_version = None  # the sync its engines hold once the calls sent to it ran (None: a full sync is due)
        self.unsent = None  # the newest SyncHandle published by a train call, not yet given to the manager
        self.loading = None  # the handle given to the manager call in flight (checked when it answers)
        self.load_seconds = 0.0  # engine load time of the calls answered since the last logged rollout
        self.publish_seconds = 0.0  # trainer export + publish time since the last logged rollout
        self.placement = None
        self.owns_ray = False
        self.step = 0
        self.start_rollout = 0
        self.samples_seen = 0  # samples consumed by optimizer steps so far (global, all DP ranks)
        self.rollout_restarts = 0  # dead rollout managers replaced so far (--max-rollout-retries)
        self.rollout_state = None  # the manager's dataset position before the next generate
        self.pending = (
            None  # (rollout_id, RolloutData, staleness): the rollout generated ahead (--max-weight-staleness 1)
        )
        self.faults = fault_points()

    # -- set-up ---------------------------------------------------------------------------------
    def _resolve_paths(self) -> None:
        a = self.args
        if is_embedded(a):
            prepare_embedded(a)
        if a.hf_checkpoint is None:
            fail(
                "--prompt-data without --hf-checkpoint",
                "the loop needs a model to train",
                "pass --hf-checkpoint DIR (a Hugging Face model directory)",
            )
        self.output_dir = Path(a.output_dir or "outputs/run")
        self.metrics_file = Path(a.metrics_file or self.output_dir / "metrics.jsonl")

    def _start(self) -> None:
        a = self.args
        self.owns_ray = init_ray(a.ray_num_cpus or required_cpus(a))
        self.placement = create_placement(a)
        self.rollout, self.engines = create_rollout_manager(
            a, self.placement, a.hf_checkpoint, a.prompt_data, a.eval_prompt_data
        )
        self.group = TrainGroup(a, self.placement)
        validate_world(a, dp_size=self.group.dp_size)

    def _resume(self) -> None:
        a = self.args
        if not a.load:
            return
        step = latest_step(a.load)
        if step is None:
            print(f"--load {a.load}: the directory holds no checkpoint yet, starting from scratch", flush=True)
            return
        try:
            metas = self.group.call("load", [(step_dir(a.load, step),)] * self.group.world_size)
        except TrainActorError as exc:
            if exc.died or not exc.error_line:
                raise
            # a checkpoint that does not fit this run (another model, another layout): the backend's
            # message names the checkpoint, the model and the fix; drop Ray's traceback around it
            raise RLArgumentError(exc.error_line.split(": ", 1)[-1]) from None
        extra = metas[0]["extra"]
        self.step = int(metas[0]["step"])
        self.start_rollout = int(extra["rollout_id"])
        self.samples_seen = int(extra.get("samples_seen", 0))
        check_progress(a, self.start_rollout, self.step)  # checkpoints without loop_state.json
        if is_finished(a, self.start_rollout):
            return
        self._rollout_call("load_state_dict", extra["rollout_state"])
        self.pending = read_pending_rollout(a.load, step)
        if self.pending is not None:
            if self.pending[0] != self.start_rollout:
                raise LoopError(
                    f"{step_dir(a.load, step)}/{PENDING_ROLLOUT} holds rollout {self.pending[0]}, but the checkpoint's "
                    f"next rollout is {self.start_rollout}: the checkpoint is inconsistent; resume from an earlier one"
                )
            print(
                f"resuming an overlapped run: rollout {self.start_rollout} was generated ahead before the checkpoint and "
                f"is trained on as it was (staleness {self.pending[2]})",
                flush=True,
            )
        print(f"resumed from {step_dir(a.load, step)}: step {self.step}, next rollout {self.start_rollout}", flush=True)
        moved = supersede_after(self.metrics_file, self.step)
        if moved:
            print(
                f"{self.metrics_file}: steps {moved[0]}-{moved[-1]} were written after the checkpoint by the interrupted run and "
                f"are trained again now; their lines moved to {self.metrics_file.stem}.superseded.jsonl",
                flush=True,
            )

    # -- pieces of a rollout -------------------------------------------------------------------
    def _rollout_call(self, method: str, *args):
        """A rollout-manager call; its failure (a raised error or a dead actor) ends the run
        with the remote error line instead of a Ray traceback."""
        try:
            return ray.get(getattr(self.rollout, method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise LoopError(
                f"rollout manager failed during {method}: {error_line(exc)}. {self._resume_hint()}"
            ) from None

    def _sync_request(self):
        """What train rank 0 publishes: the changes since the version the manager's engines will
        hold when they load it (everything for a fresh manager); two shared-memory slots when a
        generate may still be loading sync v - 1 while the trainer publishes v (overlapped)."""
        from rl_plugin.rollout.weight_sync import SyncRequest

        a = self.args
        if self.engine_nodes is None:  # asked once per rollout manager
            self.engine_nodes = tuple(self._rollout_call("engine_node_ids"))
        return SyncRequest(
            buffer_bytes=a.update_weight_buffer_size,
            transport=a.update_weight_transport,
            engine_nodes=self.engine_nodes,
            since_version=self.engine_version,
            fingerprint=bool(a.check_weight_sync),
            slots=2 if a.max_weight_staleness > 0 else 1,
        )

    def sync_weights(self) -> None:
        """A sync as a call of its own: at the start (the trainer's weights, maybe a resumed
        checkpoint's, into the engines) and into a restarted rollout manager. Train rank 0
        publishes its export (``rl_plugin.rollout.weight_sync``); its handle goes to the manager
        as an ObjectRef, so the load starts as soon as rank 0 published."""
        g = self.group
        request = self._sync_request()
        refs = g.call("export_weight_buckets", [(request,)] * g.world_size, return_refs=True)
        update = self.rollout.update_weights.remote(refs[0])
        handle = g.wait(refs, "export_weight_buckets")[0]  # a failed rank is named here, before the update's error
        try:
            load = ray.get(update)  # bytes, slowest engine's load seconds
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            if not _actor_died(exc):
                raise LoopError(
                    f"weight sync failed (rollout update): {error_line(exc)}. {self._resume_hint()}"
                ) from None
            self._restart_rollout("update_weights", exc)  # the fresh manager and engines are synced there
            return
        finally:
            del refs, update  # the buckets are freed once no one holds their handles
        self.unsent, self.engine_version, self.loading = None, handle.version, handle
        self._loaded(load)
        self.load_seconds = 0.0  # not a rollout's cost

    def _give_handle(self):
        """The newest published handle for the manager call about to be sent (None: its engines
        hold the trainer's newest weights already); the manager runs calls in order, so the
        engines hold that version for every later call."""
        handle, self.unsent = self.unsent, None
        if handle is not None:
            self.engine_version = handle.version
        self.loading = handle
        return handle

    def _loaded(self, load) -> None:
        """A manager call that loaded ``self.loading`` answered ``load`` (bytes, seconds and, under
        --check-weight-sync, every engine's fingerprint, compared with the trainer's)."""
        handle, self.loading = self.loading, None
        if handle is None:
            return
        if load is None:
            raise LoopError(f"internal: the rollout manager was given sync {handle.version} and answered no load")
        self.last_sync = {"bytes": load["bytes"], "seconds": load["seconds"]}
        self.load_seconds += load["seconds"]
        if self.args.check_weight_sync:
            for i, rollout in enumerate(load["fingerprints"]):
                try:
                    compare_fingerprints(handle.fingerprint, rollout)
                except WeightSyncError as exc:
                    raise WeightSyncError(f"rollout engine {i}: {exc}") from None

    def _generate_ref(self, k: int):
        return generate_ref(self.rollout, k, self.faults, self._give_handle())

    def _answered(self, data):
        """A generate's answer: its dataset position kept, its weight load checked."""
        self.rollout_state = data.dataset_state  # came back with the rollout: no state_dict round trip
        load, data.weight_load = data.weight_load, None
        self._loaded(load)
        return data

    def generate(self, k: int):
        """Rollout ``k`` (the newest weights loaded first); a rollout manager that dies meanwhile is
        replaced and the rollout retried (generation is seeded by ``seed + k``: the retry yields
        the samples the first try would)."""
        return self._answered(self._retrying("generate", k, lambda: self._generate_ref(k)))

    def evaluate(self, k: int) -> Dict[str, float]:
        """The eval after rollout k, on the weights after its steps (loaded first when not yet)."""
        ev = self._retrying("evaluate", k, lambda: self.rollout.evaluate.remote(k, self._give_handle()))
        self._loaded(ev.pop("weight_load", None))
        return ev

    def _retrying(self, method: str, k: int, submit, first=None):
        """``ray.get(submit())`` (or of ``first``, a call already in flight), resubmitted to a fresh
        rollout manager when the actor died; an error raised inside the call (bad data, a reward
        function) ends the run at once."""
        ref = first
        while True:
            try:
                return ray.get(submit() if ref is None else ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                if not _actor_died(exc):
                    raise LoopError(
                        f"rollout manager failed during {method}: {error_line(exc)}. {self._resume_hint()}"
                    ) from None
                ref = None
                self._restart_rollout(f"{method} (rollout {k})", exc)

    def _restart_rollout(self, during: str, exc: Exception) -> None:
        """Replace a dead rollout manager: a fresh actor at the dataset position of before the
        failed call, loaded with the trainer's current weights. At most --max-rollout-retries
        times per run; then the run stops naming the engine, the cause and --load."""
        a = self.args
        cause = error_line(exc)
        engine = (
            f"the rollout engine ({a.rollout_engine}, in the rollout manager actor)"
            if not self.engines
            else f"a rollout engine ({a.rollout_engine}, one of {len(self.engines)} engine actors) or its manager"
        )
        if self.rollout_restarts >= a.max_rollout_retries:
            raise LoopError(
                f"{engine} died during {during}: {cause}. It was restarted {self.rollout_restarts} time(s) already "
                f"(--max-rollout-retries {a.max_rollout_retries}). {self._resume_hint()}"
            )
        self.rollout_restarts += 1
        print(
            f"{engine} died during {during}: {cause}; restarting it and retrying "
            f"({self.rollout_restarts}/{a.max_rollout_retries}, --max-rollout-retries)",
            flush=True,
        )
        for actor in [self.rollout, *self.engines]:
            ray.kill(actor, no_restart=True)
        self.rollout, self.engines = create_rollout_manager(
            a, self.placement, a.hf_checkpoint, a.prompt_data, a.eval_prompt_data
        )
        # the fresh engines hold the checkpoint's weights: a full sync of the trainer's current ones
        self.engine_nodes = self.engine_version = self.unsent = self.loading = None
        self._rollout_call("load_state_dict", self.rollout_state)
        self.sync_weights()

    def train_rollout(self, data, sync: bool = False) -> List[Dict[str, Any]]:
        """Rollout ``data``'s optimizer steps on every rank; with ``sync``, the ranks then export
        and rank 0 publishes the new weights in the same call (``self.unsent``: given to the next
        manager call). Returns the step reports."""
        a, g = self.args, self.group
        batch = rollout_batch(data, a.advantage_estimator)
        if a.docs_per_step is not None:  # planned by the ranks: collective over DP
            shares = split_rollout_for_dp(batch, g.dp_size)
            plans = g.call("plan_docs_steps", [(shares[g.dp_rank(r)], data.num_groups) for r in range(g.world_size)])
        else:
            by_dp = plan_global_batch_steps(
                batch, global_batch_size=a.global_batch_size or batch.num_samples, dp_size=g.dp_size
            )
            plans = [by_dp[g.dp_rank(r)] for r in range(g.world_size)]
        request = self._sync_request() if sync else None
        per_rank = [(plan, request) for plan in plans]  # one RankPlan per rank; every rank exports
        reports, handle = g.call("train_rollout_and_sync", per_rank)[0]
        if handle is not None:
            self.unsent = handle
            self.publish_seconds += handle.export_seconds + handle.publish_seconds
        return reports

    def save(self, rollout_id: int) -> None:
        a = self.args
        # the dataset position after rollout_id's generate (training, sync and eval do not move it);
        # overlapped, after rollout_id + 1's, which the checkpoint then holds (pending_rollout.pt)
        extra = {"rollout_id": rollout_id + 1, "rollout_state": self.rollout_state, "samples_seen": self.samples_seen}
        staging = begin_save(a.save, self.step)  # the layout: rl_plugin.loop.checkpoint
        self.group.call("save", [(str(staging), self.step, extra)] * self.group.world_size)
        state = {
            "step": self.step,
            "next_rollout": rollout_id + 1,
            "samples_seen": self.samples_seen,
            "train_backend": a.train_backend,
            "num_rollout": a.num_rollout,
        }
        if self.pending is not None:  # overlapped: rollout_id + 1, generated ahead, is trained on at resume
            write_pending_rollout(staging, *self.pending)
            state["pending_rollout"] = PENDING_ROLLOUT
        commit_save(a.save, self.step, state)  # loop_state.json, rename, tracker: once every rank wrote

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        validate_engine_installed(a)
        self._resolve_paths()
        point = preflight(a)  # everything that needs no world: RLArgumentError before Ray starts
        if point is not None and is_finished(a, point.next_rollout):
            print(finished_message(a, point.step), flush=True)
            return
        warning = staleness_warning(a)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        lock = RunLock(self.output_dir).acquire()
        # The driver's torch work is bookkeeping on ~1e3-element tensors (advantages, step plans):
        # intra-op threads only add OpenMP hand-offs, and with the node's cores busy in the actors
        # a hand-off waits for a descheduled thread (measured: ~14 ms per repeat_interleave, ~20
        # ms per rollout on the embedded run). One thread; the caller's setting comes back after.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if a.overwrite_save:
                moved = move_checkpoints_aside(a.save)
                if moved is not None:
                    print(f"--overwrite-save: the earlier checkpoints of {a.save} were moved to {moved}", flush=True)
            self._run_loop()
        finally:
            torch.set_num_threads(threads)
            lock.release()

    def _run_loop(self) -> None:
        from tqdm import tqdm

        a = self.args
        logger = None
        k = None
        try:
            self._start()
            self._resume()
            if is_finished(a, self.start_rollout):
                print(finished_message(a, self.step), flush=True)
                return
            if self.step == 0:
                _keep_previous(self.metrics_file)
            self.rollout_state = self._rollout_call("state_dict")
            self.sync_weights()
            logger = MetricsLogger(a, str(self.metrics_file))
            bar = tqdm(
                total=a.num_rollout,
                initial=self.start_rollout,
                disable=a.no_progress_bar,
                desc="rollouts",
                dynamic_ncols=True,
            )
            one_rollout = self._overlapped_rollout if a.max_weight_staleness > 0 else self._one_rollout
            for k in range(self.start_rollout, a.num_rollout):
                one_rollout(k, logger, bar)
            bar.close()
        except KeyboardInterrupt:
            where = f"during rollout {k} (after step {self.step})" if k is not None else "during start-up"
            raise Interrupted(f"interrupted (Ctrl-C) {where}. {self._resume_hint()}") from None
        except TrainActorError as exc:
            raise LoopError(f"{exc}. {self._resume_hint()}") from None
        except RolloutSetupError as exc:
            raise LoopError(str(exc)) from None
        finally:
            if logger is not None:
                logger.close()
            self._teardown()
        png = plot_reward_curve(
            self.metrics_file, self.output_dir / "reward_curve.png", title=f"rl_plugin ({a.train_backend})"
        )
        print(f"metrics: {self.metrics_file}\nreward curve: {png}", flush=True)

    def _teardown(self) -> None:
        """Kill this run's actors and free its placement (the Ray cluster may outlive the run).
        Best effort: after Ctrl-C the cluster's processes may already be gone."""
        try:
            if self.group is not None:
                self.group.kill()
            if self.rollout is not None:
                ray.kill(self.rollout, no_restart=True)
            for engine in self.engines:
                ray.kill(engine, no_restart=True)
            if self.placement is not None:
                self.placement.remove()
        except Exception:  # noqa: BLE001 - never hide the run's own error behind a teardown error
            pass
        finally:
            if self.owns_ray:
                shutdown_ray()

    def _eval_due(self, k: int) -> bool:
        a = self.args
        return bool(a.eval_interval) and ((k + 1) % a.eval_interval == 0 or k + 1 == a.num_rollout)

    def _sync_due(self, k: int, ahead: int) -> bool:
        """Whether the train call of rollout k publishes its weights: some later call loads them
        (the eval after rollout k, or the generate of rollout k + 1 + ``ahead``)."""
        return self._eval_due(k) or k + 1 + ahead < self.args.num_rollout

    def _sync_timings(self) -> Dict[str, float]:
        """The weight sync's share of this rollout, measured in the actors: the trainer's export
        and publish in its train call, the engines' loads in the manager calls answered since the
        last rollout was logged (the generate; an eval's load counts towards the next rollout)."""
        out = {
            "time/weight_sync": self.publish_seconds + self.load_seconds,
            "time/weight_publish": self.publish_seconds,
            "time/weight_load_engines": self.load_seconds,
        }
        self.publish_seconds = self.load_seconds = 0.0
        return out

    def _one_rollout(self, k: int, logger: MetricsLogger, bar) -> None:
        """The synchronous loop (``--max-weight-staleness 0``): generate rollout k (loading the
        weights rollout k - 1's train call published), train on it and publish."""
        t0 = time.perf_counter()
        data = self.generate(k) if self.pending is None else self._take_pending(k)
        t_gen = time.perf_counter() - t0
        t1 = time.perf_counter()
        reports = self.train_rollout(data, sync=self._sync_due(k, ahead=0))
        t_train = time.perf_counter() - t1
        timings = {"time/rollout_call": t_gen, "time/train": t_train, **self._sync_timings()}
        self._finish_rollout(k, data, reports, timings, t0, logger, bar)

    def _overlapped_rollout(self, k: int, logger: MetricsLogger, bar) -> None:
        """Overlapped training (``--max-weight-staleness 1``; slime's ``train_async.py``):

            submit generate(k+1)   loading first the weights after rollout k-1
            train(k)               at the same time, on the trainer; publishes the weights after k
            wait for generate(k+1) the engine is never updated mid-generation: the weights after
                                   k are loaded by generate(k+2) (or the eval after rollout k)

        The publish of sync v and the load of sync v - 1 run at the same time: the shared-memory
        segment is double-buffered (``SyncRequest.slots = 2``, ``weight_sync``).

        Rollout k+1 is then trained on at the next iteration by weights one rollout newer than
        those that sampled it (staleness 1); the trainer's old log-probs are recomputed on its
        current weights and the engine's log-probs describe the sampler, so ``--use-tis`` corrects
        the lag and the ``mismatch/*`` metrics measure it. The first rollout of a run (or of a
        resume from a synchronous checkpoint) is generated in place, by the current weights."""
        a = self.args
        t0 = time.perf_counter()
        staleness, wait_gen, call = 0, 0.0, None
        if self.pending is None:
            data = self.generate(k)
            call = wait_gen = time.perf_counter() - t0
        else:
            staleness = self.pending[2]
            data = self._take_pending(k)
        ahead = None
        if k + 1 < a.num_rollout:
            restarts = self.rollout_restarts
            ahead = self._generate_ref(k + 1)
        t1 = time.perf_counter()
        # a failure here ends the run; the teardown kills the generating actor
        reports = self.train_rollout(data, sync=self._sync_due(k, ahead=1))
        t_train = time.perf_counter() - t1
        timings: Dict[str, float] = {}
        if ahead is not None:
            t2 = time.perf_counter()
            try:
                nxt = self._answered(self._retrying("generate", k + 1, lambda: self._generate_ref(k + 1), first=ahead))
            except LoopError:
                self._log_rows(
                    k, data, reports, {"time/train": t_train}, t0, logger, bar, staleness
                )  # steps done stay logged
                raise
            wait_gen += time.perf_counter() - t2
            # a manager that died meanwhile was replaced and synced with the trainer's current weights
            # (the full sync supersedes the handle train(k) published): no lag
            self.pending = (k + 1, nxt, 0 if self.rollout_restarts > restarts else 1)
            ahead_s = nxt.stats.get("rollout_gen_time", 0.0) + nxt.stats.get("rollout_reward_time", 0.0)
            timings.update(
                {
                    "time/generate_ahead": ahead_s,  # the engine's own time on rollout k+1 (generate + reward)
                    "time/engine_wait_trainer": max(
                        0.0, t2 - t1 - ahead_s
                    ),  # engine idle until training ended (approx.)
                    "time/overlap_saved": max(
                        0.0, ahead_s - (time.perf_counter() - t2)
                    ),  # generation hidden behind training
                }
            )
        timings["time/trainer_wait_generate"] = wait_gen
        if call is not None:
            timings["time/rollout_call"] = call
        timings.update({"time/train": t_train, **self._sync_timings()})
        self._finish_rollout(k, data, reports, timings, t0, logger, bar, staleness=staleness)

    def _take_pending(self, k: int):
        rollout_id, data, _ = self.pending
        if rollout_id != k:
            raise LoopError(
                f"internal: the rollout generated ahead is rollout {rollout_id}, the loop is at rollout {k}"
            )
        self.pending = None
        return data

    def _finish_rollout(
        self,
        k: int,
        data,
        reports,
        timings: Dict[str, float],
        t0: float,
        logger: MetricsLogger,
        bar,
        staleness: Optional[int] = None,
    ) -> None:
        """Log rollout k's steps, then checkpoint and evaluate when due."""
        a = self.args
        self._log_rows(k, data, reports, timings, t0, logger, bar, staleness)
        if a.save and ((a.save_interval and (k + 1) % a.save_interval == 0) or k + 1 == a.num_rollout):
            self.save(k)
        if self._eval_due(k):
            logger.log(self.step, {"rollout_id": k, **self.evaluate(k)})
        stats = data.stats
        bar.set_postfix(
            reward=f"{stats['reward_mean']:.3f}",
            gen_s=f"{stats.get('rollout_gen_time', 0.0):.2f}",
            reward_s=f"{stats.get('rollout_reward_time', 0.0):.2f}",
            train_s=f"{timings.get('time/train', 0.0):.2f}",
            step=self.step,
        )
        bar.update(1)

    def _log_rows(
        self,
        k: int,
        data,
        reports,
        timings: Dict[str, float],
        t0: float,
        logger: MetricsLogger,
        bar,
        staleness: Optional[int],
    ) -> None:
        a = self.args
        stats = {key: data.stats[key] for key in ROLLOUT_STATS}
        stats.update({key: v for key, v in data.stats.items() if key.startswith(ROLLOUT_STAT_PREFIXES)})
        if staleness is not None:  # overlapped runs only: the synchronous loop's metrics stay as they were
            stats["weight_staleness"] = float(staleness)
        t_engine, t_reward = (
            data.stats.get("rollout_gen_time", timings.get("time/rollout_call", 0.0)),
            data.stats.get("rollout_reward_time", 0.0),
        )
        for j, rep in enumerate(reports):
            self.step += 1
            self.samples_seen += int(rep["samples"])
            rep["samples_seen"] = float(self.samples_seen)
            if a.docs_per_step is not None:  # DeepSpeed's names for the step's document counts
                rep["num_documents"], rep["documents_seen"] = rep["samples"], float(self.samples_seen)
            step_timings = {key: rep.pop(key) for key in list(rep) if key.startswith("time/")}
            if j == 0:  # rollout_generate: the engine; rollout_reward: scoring; rollout_call: the whole remote call
                step_timings.update(
                    {
                        "time/rollout_generate": t_engine,
                        "time/rollout_reward": t_reward,
                        **timings,
                        "time/rollout_total": time.perf_counter() - t0,
                    }
                )
            row = {"rollout_id": k, "step_in_rollout": j, **stats, **rep}
            logger.log(self.step, row, step_timings)
            if self.step % a.log_interval == 0:
                (bar.write if not a.no_progress_bar else print)(summary_line(self.step, row, step_timings))
                sys.stdout.flush()

    def _resume_hint(self) -> str:
        a = self.args
        if a.save and latest_step(a.save) is not None:
            return (
                f"Completed steps are in {self.metrics_file}; resume with --load {a.save} (last checkpoint: step {latest_step(a.save)}): "
                f"{resume_command(self.argv, a.save)}"
            )
        return f"Completed steps are in {self.metrics_file}; no checkpoint was written (pass --save DIR --save-interval N to make runs resumable)"
