"""The driver of ``rl-plugin-train``: a thin schedule over the objects it owns.

It owns the train group (one actor per rank), the rollout client (the manager actor, its engines,
retries), the weight ledger (which weights the engines hold), the run's progress and the row
logger, and runs one schedule over them: ``sync_schedule`` (default) or ``overlapped_schedule``
(``--max-weight-staleness 1``). Per rollout k::

    data    = generate(k)                  # the manager loads the newest published weights first
    reports = train_rollout(data, sync)    # advantages, the plan of steps, the steps; rank 0 publishes
    finish_rollout(k)                      # rows, checkpoint, eval when due

The weight sync rides on those calls (``rl_plugin.weight_sync``): only the first sync of a run
(or of a fresh rollout manager) is a call of its own (``sync_weights``).

Before Ray starts, ``preflight`` checks everything that needs no world and the driver takes the
output directory's lock (``run_lock``). Failures end the run with a ``LoopError`` naming what broke
and where to resume from; Ctrl-C ends it with one line naming the last checkpoint and the
``--load`` command. The metrics file keeps every line already written and the last complete
checkpoint stays the resume point (``resume.py``).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence

import ray
import torch

from rl_plugin.arguments import validate_world
from rl_plugin.checkpoint.commit import move_checkpoints_aside, remove_partial
from rl_plugin.checkpoint.disk_space import directory_bytes, disk_full_message
from rl_plugin.checkpoint.layout import latest_step, partial_dir, resume_step, step_dir
from rl_plugin.configs.async_training import staleness_warning
from rl_plugin.configs.engine import validate_engine_installed
from rl_plugin.errors import Interrupted, LoopError, Stopped, fail
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.embedded import is_embedded, prepare_embedded
from rl_plugin.loop.exit_request import ExitRequest
from rl_plugin.loop.overlapped_schedule import run_overlapped_rollout
from rl_plugin.loop.plot import plot_reward_curve
from rl_plugin.loop.preflight import check_progress, finished_message, is_finished, preflight
from rl_plugin.loop.resume import (
    Pending,
    Progress,
    load_train_state,
    read_pending,
    resume_hint,
    save_checkpoint,
    supersede_metrics,
)
from rl_plugin.loop.rollout_client import RolloutClient, actor_died
from rl_plugin.loop.rows import RowLogger, keep_previous
from rl_plugin.loop.run_lock import RunLock
from rl_plugin.loop.steps import rollout_batch
from rl_plugin.loop.sync_schedule import run_sync_rollout
from rl_plugin.ray.cluster import create_placement, init_ray, required_cpus, shutdown_ray
from rl_plugin.ray.rollout_actor import RolloutSetupError, error_line
from rl_plugin.ray.train_group import TrainActorError, TrainGroup
from rl_plugin.rollout.rollout_data import RolloutData
from rl_plugin.step_plan import plan_global_batch_steps, split_rollout_for_dp
from rl_plugin.weight_sync import WeightLedger


class Driver:
    def __init__(self, args, argv: Optional[Sequence[str]] = None):
        self.args = args  # for preflight and the constructors of what the driver owns
        self.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command in messages
        self.cfg: Optional[LoopConfig] = None  # built once the embedded default filled in its paths
        self.group: Optional[TrainGroup] = None
        self.client: Optional[RolloutClient] = None
        self.ledger: Optional[WeightLedger] = None
        self.rows: Optional[RowLogger] = None
        self.placement = None
        self.owns_ray = False
        self.progress = Progress()
        self.pending: Optional[Pending] = None  # the rollout generated ahead (--max-weight-staleness 1)
        self.exit: Optional[ExitRequest] = None  # exit signals and --exit-duration-in-mins

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        validate_engine_installed(a)
        if is_embedded(a):
            prepare_embedded(a)
        if a.hf_checkpoint is None:
            fail(
                "--prompt-data without --hf-checkpoint",
                "the loop needs a model to train",
                "pass --hf-checkpoint DIR (a Hugging Face model directory)",
            )
        self.cfg = cfg = LoopConfig.from_args(a)
        self.exit = ExitRequest(
            handle_signals=a.exit_signal_handler, duration_mins=a.exit_duration_in_mins, will_save=bool(cfg.save)
        )
        self.exit.install()
        try:
            self._checked_run()
        finally:
            self.exit.restore()

    def _checked_run(self) -> None:
        a, cfg = self.args, self.cfg
        point = preflight(a)  # everything that needs no world: RLArgumentError before Ray starts
        if point is not None and is_finished(a, point.next_rollout):
            print(finished_message(a, point.step), flush=True)
            return
        warning = staleness_warning(a)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        self._stop_if_asked(None)  # a signal during the checks: nothing started yet
        lock = RunLock(cfg.output_dir).acquire()
        # The driver's torch work is bookkeeping on ~1e3-element tensors (advantages, step plans):
        # intra-op threads only add OpenMP hand-offs, and with the node's cores busy in the actors
        # a hand-off waits for a descheduled thread (measured: ~14 ms per repeat_interleave, ~20
        # ms per rollout on the embedded run). One thread; the caller's setting comes back after.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if cfg.overwrite_save:
                moved = move_checkpoints_aside(cfg.save)
                if moved is not None:
                    print(f"--overwrite-save: the earlier checkpoints of {cfg.save} were moved to {moved}", flush=True)
            self._run_loop()
        finally:
            torch.set_num_threads(threads)
            lock.release()

    def _run_loop(self) -> None:
        cfg = self.cfg
        one_rollout = run_overlapped_rollout if cfg.overlapped else run_sync_rollout
        k = None
        try:
            self._start()
            self._resume()
            if is_finished(self.args, self.progress.start_rollout):
                print(finished_message(self.args, self.progress.step), flush=True)
                return
            if self.progress.step == 0:
                keep_previous(cfg.metrics_file)
            self.client.dataset_state = self.client.call("state_dict")
            self.sync_weights()
            self._stop_if_asked(None)  # asked during start-up: nothing trained since the checkpoint
            self.rows = RowLogger(self.args, cfg, self.progress.start_rollout)
            for k in range(self.progress.start_rollout, cfg.num_rollout):
                one_rollout(self, k)
                if k + 1 < cfg.num_rollout:
                    self._stop_if_asked(k)
        except KeyboardInterrupt:
            where = f"during rollout {k} (after step {self.progress.step})" if k is not None else "during start-up"
            raise Interrupted(f"interrupted (Ctrl-C) {where}. {self.resume_hint()}") from None
        except Interrupted as exc:  # a second exit signal: abort without saving
            where = f"during rollout {k} (after step {self.progress.step})" if k is not None else "during start-up"
            raise Interrupted(f"{exc} {where}. {self.resume_hint()}", exc.exit_code) from None
        except TrainActorError as exc:
            raise LoopError(f"{exc}. {self.resume_hint()}") from None
        except RolloutSetupError as exc:
            raise LoopError(str(exc)) from None
        finally:
            if self.rows is not None:
                self.rows.close()
            self._teardown()
        png = plot_reward_curve(
            cfg.metrics_file, cfg.output_dir / "reward_curve.png", title=f"rl_plugin ({cfg.train_backend})"
        )
        print(f"metrics: {cfg.metrics_file}\nreward curve: {png}", flush=True)

    def resume_hint(self) -> str:
        return resume_hint(self.cfg, self.argv)

    def _stop_if_asked(self, k: Optional[int]) -> None:
        """Between two rollouts (``k``: the last one done; None: before the first): when an exit
        signal or --exit-duration-in-mins asks, write a checkpoint of rollout k (unless the loop
        just wrote it) and stop with the resume command."""
        reason = self.exit.reason()
        if reason is None:
            return
        cfg = self.cfg
        if k is not None and cfg.save and not cfg.save_due(k):
            self._save(k)
        where = f"after rollout {k} (step {self.progress.step})" if k is not None else "before training started"
        raise Stopped(f"{reason} {where}. {self.resume_hint()}", self.exit.exit_code())

    # -- set-up, resume, teardown -------------------------------------------------------------------
    def _start(self) -> None:
        a = self.args
        self.owns_ray = init_ray(a.ray_num_cpus or required_cpus(a))
        self.exit.install()  # ray.init sets its own SIGTERM handler (exit at once): take it back
        self.placement = create_placement(a)
        self.ledger = WeightLedger(self.cfg.sync)
        self.client = RolloutClient(a, self.cfg, self.placement, self.resume_hint)
        self.client.on_fresh_engines = self.ledger.fresh_engines
        self.client.on_restart = self.sync_weights
        self.group = TrainGroup(a, self.placement)
        validate_world(a, dp_size=self.group.dp_size)
        if self.ledger.distributed:  # train rank 0 hosts the weight group's store
            host, port, _ = ray.get(self.group.actors[0].address.remote())
            self.ledger.rendezvous = (host, port)

    def _resume(self) -> None:
        cfg = self.cfg
        if not cfg.load:
            return
        step = resume_step(cfg.load, cfg.ckpt_step)
        if step is None:
            print(f"--load {cfg.load}: the directory holds no checkpoint yet, starting from scratch", flush=True)
            return
        meta = load_train_state(self.group, cfg.load, step)
        extra = meta["extra"]
        p = self.progress
        p.step, p.start_rollout = int(meta["step"]), int(extra["rollout_id"])
        p.samples_seen = int(extra.get("samples_seen", 0))
        check_progress(self.args, p.start_rollout, p.step)  # checkpoints without loop_state.json
        if is_finished(self.args, p.start_rollout):
            return
        self.client.call("load_state_dict", extra["rollout_state"])
        self.pending = read_pending(cfg, step, p.start_rollout, cfg.rollout_batch_size)
        print(f"resumed from {step_dir(cfg.load, step)}: step {p.step}, next rollout {p.start_rollout}", flush=True)
        supersede_metrics(cfg, p.step)

    def _teardown(self) -> None:
        """Kill this run's actors and free its placement (the Ray cluster may outlive the run).
        Best effort: after Ctrl-C the cluster's processes may already be gone."""
        try:
            if self.group is not None:
                self.group.kill()
            if self.client is not None:
                self.client.kill()
            if self.placement is not None:
                self.placement.remove()
        except Exception:  # noqa: BLE001 - never hide the run's own error behind a teardown error
            pass
        finally:
            if self.owns_ray:
                shutdown_ray()

    # -- the pieces a schedule runs -------------------------------------------------------------------
    def sync_weights(self) -> None:
        """A sync as a call of its own: at the start (the trainer's weights, maybe a resumed
        checkpoint's, into the engines) and into a restarted rollout manager. Train rank 0
        publishes its export; its handle goes to the manager as an ObjectRef, so the load starts
        as soon as rank 0 published."""
        g = self.group
        request = self.ledger.request(self.client.engine_node_ids)
        refs = g.call("export_weight_buckets", [(request,)] * g.world_size, return_refs=True)
        announced = self.ledger.announce(request)  # distributed: the engines receive while rank 0 publishes
        update = self.client.submit_update(refs[0] if announced is None else announced)
        handle = g.wait(refs, "export_weight_buckets")[0]  # a failed rank is named here, before the update's error
        load = self._wait_update(update)
        del refs, update  # the buckets are freed once no one holds their handles
        if load is not None:
            self.ledger.synced_fully(handle, load)

    def _wait_update(self, update) -> Optional[Dict[str, Any]]:
        """The manager's answer to a weight load (bytes, the slowest engine's seconds); None when
        it died and was replaced (the fresh manager and engines were synced by the restart)."""
        try:
            return ray.get(update)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            if not actor_died(exc):
                raise LoopError(
                    f"weight sync failed (rollout update): {error_line(exc)}. {self.resume_hint()}"
                ) from None
            self.client.restart("update_weights", exc)
            return None

    def _save(self, k: int) -> None:
        """The checkpoint after rollout k. A save that fails for lack of space says so and removes
        its ``.partial`` (never a resume point), so the disk keeps the space it had."""
        cfg = self.cfg
        try:
            save_checkpoint(cfg, self.group, self.progress, k, self.client.dataset_state, self.pending)
        except (OSError, RuntimeError) as exc:  # a rank that raised (TrainActorError), the driver's own writes
            staging, last = partial_dir(cfg.save, self.progress.step), latest_step(cfg.save)
            remove_partial(staging)
            full = disk_full_message(
                cfg.save, str(exc), directory_bytes(step_dir(cfg.save, last)) if last is not None else None
            )
            if full is None:
                raise
            raise LoopError(
                f"saving step {self.progress.step} failed: {full}. The unfinished save {staging} was removed. "
                f"Fix: free space there or point --save at a larger disk. {self.resume_hint()}"
            ) from None

    def submit_generate(self, k: int):
        """Rollout k's generate, handed the newest published weights to load first."""
        return self.client.submit_generate(k, self.ledger.give())

    def answered(self, data: RolloutData) -> RolloutData:
        """A generate's answer: its dataset position kept, its weight load checked."""
        self.client.answered(data)
        load, data.weight_load = data.weight_load, None
        self.ledger.loaded(load)
        return data

    def generate(self, k: int) -> RolloutData:
        """Rollout ``k`` (the newest weights loaded first); a rollout manager that dies meanwhile is
        replaced and the rollout retried (the retry yields the samples the first try would)."""
        return self.answered(self.client.retrying("generate", k, lambda: self.submit_generate(k)))

    def evaluate(self, k: int) -> Dict[str, float]:
        """The eval after rollout k, on the weights after its steps (loaded first when not yet)."""
        ev = self.client.retrying("evaluate", k, lambda: self.client.manager.evaluate.remote(k, self.ledger.give()))
        self.ledger.loaded(ev.pop("weight_load", None))
        return ev

    def take_pending(self, k: int) -> RolloutData:
        rollout_id, data, _ = self.pending
        if rollout_id != k:
            raise LoopError(
                f"internal: the rollout generated ahead is rollout {rollout_id}, the loop is at rollout {k}"
            )
        self.pending = None
        return data

    def train_rollout(self, data: RolloutData, sync: bool = False) -> List[Dict[str, Any]]:
        """Rollout ``data``'s optimizer steps on every rank; with ``sync``, the ranks then export
        and rank 0 publishes the new weights in the same call (the ledger gives them to the next
        manager call). Returns the step reports."""
        cfg, g = self.cfg, self.group
        batch = rollout_batch(data, cfg.advantage_estimator)
        if cfg.docs_per_step is not None:  # planned by the ranks: collective over DP
            shares = split_rollout_for_dp(batch, g.dp_size)
            plans = g.call("plan_docs_steps", [(shares[g.dp_rank(r)], data.num_groups) for r in range(g.world_size)])
        else:
            by_dp = plan_global_batch_steps(
                batch, global_batch_size=cfg.global_batch_size or batch.num_samples, dp_size=g.dp_size
            )
            plans = [by_dp[g.dp_rank(r)] for r in range(g.world_size)]
        request = self.ledger.request(self.client.engine_node_ids) if sync else None
        per_rank = [(plan, request) for plan in plans]  # one RankPlan per rank; every rank exports
        announced = self.ledger.announce(request) if request is not None else None
        if announced is None:
            reports, handle = g.call("train_rollout_and_sync", per_rank)[0]
            self.ledger.published(handle)
            return reports
        # distributed: the manager receives while rank 0 broadcasts at the end of its train call
        refs = g.call("train_rollout_and_sync", per_rank, return_refs=True)
        update = self.client.submit_update(announced)
        reports, handle = g.wait(refs, "train_rollout_and_sync")[0]
        load = self._wait_update(update)
        if load is not None:
            self.ledger.loaded_while_published(handle, load)
        return reports

    def finish_rollout(
        self,
        k: int,
        data: RolloutData,
        reports: List[Dict[str, Any]],
        timings: Dict[str, float],
        t0: float,
        staleness: Optional[int] = None,
    ) -> None:
        """Log rollout k's steps, then checkpoint and evaluate when due."""
        cfg = self.cfg
        self.rows.log_steps(self.progress, k, data, reports, timings, t0, staleness)
        if cfg.save_due(k):
            self._save(k)
        if cfg.eval_due(k):
            self.rows.log_eval(self.progress.step, k, self.evaluate(k))
        self.rows.advance(data, timings, self.progress.step)
