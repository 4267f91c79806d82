"""The run of ``rl-plugin-train``, start to end, around the rollouts the driver runs.

Before Ray starts, ``preflight`` checks everything that needs no world and the run takes the
output directory's lock (``run_lock``). Then: start Ray, the placement, the rollout client
(``rl_plugin.ray.rollout_client``), the train group and the weight ledger; resume (``--load``);
the first weight sync; then ``Driver.run_rollout(k)`` for each rollout, stopping between two
rollouts when an exit signal or ``--exit-duration-in-mins`` asks; at the end (or on any failure)
the actors and the placement go, and Ray with them when this run started it.

An exit signal (SIGTERM, SIGUSR1, SIGHUP, Ctrl-C) also cuts the rollout in progress
(``exit_request``: the driver's waits poll it; the train call stops before its next optimizer
step, the generate aborts; neither request waits for its answer): the run then saves the
last complete rollout, with the rollout generated but not trained on (``Schedule.pending``), and
stops with 128 + N. Every way out releases the output lock, the watchdog's and the second
signal's exit at once included.

Failures end the run with a ``LoopError`` naming what broke and where to resume from; Ctrl-C under
``--no-exit-signal-handler`` ends it at once with one line naming the last checkpoint and the
``--load`` command. The metrics file keeps
every line already written and the last complete checkpoint stays the resume point
(``resume.py``).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch

from rl_plugin.arguments import validate_world
from rl_plugin.checkpoint.commit import move_checkpoints_aside
from rl_plugin.checkpoint.layout import resume_step, step_dir
from rl_plugin.checkpoint.run_settings import settings_of
from rl_plugin.configs.async_training import stale_drop_warning, staleness_warning
from rl_plugin.configs.engine import validate_engine_installed
from rl_plugin.errors import Interrupted, LoopError, Stopped, StopRequested, fail
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.driver import Driver
from rl_plugin.loop.embedded import is_embedded, prepare_embedded
from rl_plugin.loop.exit_request import ExitRequest
from rl_plugin.loop.plot import plot_reward_curve
from rl_plugin.loop.preflight import check_progress, finished_message, is_finished, preflight
from rl_plugin.loop.resume import Progress, load_train_state, read_pending, resume_hint, supersede_metrics
from rl_plugin.loop.rows import RowLogger, keep_previous
from rl_plugin.loop.run_lock import RunLock
from rl_plugin.loop.sft_data import SftData
from rl_plugin.ray.cluster import create_placement, init_ray, required_cpus, shutdown_ray
from rl_plugin.ray.rollout_actor import RolloutSetupError
from rl_plugin.ray.rollout_client import RolloutClient
from rl_plugin.ray.train_group import TrainActorError, TrainGroup
from rl_plugin.weight_sync import WeightLedger


class TrainingRun:
    def __init__(self, args, argv: Optional[Sequence[str]] = None):
        self.args = args  # for preflight and the constructors of what the run starts
        self.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command in messages
        self.cfg: Optional[LoopConfig] = None  # built once the embedded default filled in its paths
        self.progress = Progress()
        self.exit: Optional[ExitRequest] = None  # exit signals and --exit-duration-in-mins
        # what _start starts, in order; _teardown stops whatever of it exists
        self.owns_ray = False
        self.placement = None
        self.client: Optional[RolloutClient] = None
        self.group: Optional[TrainGroup] = None
        self.driver: Optional[Driver] = None
        self.rows: Optional[RowLogger] = None

    def run(self) -> None:
        a = self.args
        # first: the exit signals are blocked in every thread started from now on (exit_request)
        self.exit = ExitRequest(
            handle_signals=a.exit_signal_handler,
            duration_mins=a.exit_duration_in_mins,
            will_save=bool(a.save),
            grace_s=a.exit_signal_grace_s,
        )
        self.exit.install()
        try:
            if a.loss_type != "sft_loss":  # SFT starts no engine
                validate_engine_installed(a)
            if is_embedded(a):
                prepare_embedded(a)
            if a.hf_checkpoint is None:
                fail(
                    "--prompt-data without --hf-checkpoint",
                    "the loop needs a model to train",
                    "pass --hf-checkpoint DIR (a Hugging Face model directory)",
                )
            self.cfg = LoopConfig.from_args(a, run_settings=settings_of(a))  # settings: for a resume's note
            self.exit.resume_hint = self.resume_hint
            self._checked_run()
        finally:
            self.exit.restore()

    def _checked_run(self) -> None:
        a, cfg = self.args, self.cfg
        point = preflight(a)  # everything that needs no world: RLArgumentError before Ray starts
        if point is not None and is_finished(a, point.next_rollout):
            print(finished_message(a, point.step), flush=True)
            return
        for warning in (staleness_warning(a), stale_drop_warning(a)):
            if warning:
                print(warning, file=sys.stderr, flush=True)
        self._stop_if_asked(None)  # a signal during the checks: nothing started yet
        lock = RunLock(cfg.output_dir).acquire()
        self.exit.release_lock = lock.release  # an exit at once (a second signal, the grace's end) too
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
        cfg, progress = self.cfg, self.progress
        k = None
        try:
            self._start()
            self._resume()
            if is_finished(self.args, progress.start_rollout):
                print(finished_message(self.args, progress.step), flush=True)
                return
            if progress.step == 0:
                keep_previous(cfg.metrics_file)
            self.client.read_dataset_state()
            if not cfg.sft:  # SFT: no engine to hold the weights
                self.driver.sync_weights()
            self._stop_if_asked(None)  # asked during start-up: nothing trained since the checkpoint
            self.rows = RowLogger(self.args, cfg, progress.start_rollout)
            self.driver.log_to(self.rows)
            for k in range(progress.start_rollout, cfg.num_rollout):
                try:
                    self.driver.run_rollout(k)
                except StopRequested as exc:
                    self._stop_cut(k, exc)
                if k + 1 < cfg.num_rollout:
                    self._stop_if_asked(k)
            self.exit.finished = True  # a signal from now on ends nothing: the run is done
        except KeyboardInterrupt:
            where = f"during rollout {k} (after step {progress.step})" if k is not None else "during start-up"
            raise Interrupted(f"interrupted (Ctrl-C) {where}. {self.resume_hint()}") from None
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
        if self.exit.signum is not None:
            print("(the exit signal came after the last rollout: the run finished; exit 0)", flush=True)

    def resume_hint(self) -> str:
        return resume_hint(self.cfg, self.argv)

    def _stop_if_asked(self, k: Optional[int]) -> None:
        """Between two rollouts (``k``: the last one done; None: before the first): when an exit
        signal or --exit-duration-in-mins asks, write a checkpoint of rollout k (unless the loop
        just wrote it) and stop with the resume command."""
        reason = self.exit.reason()
        if reason is None:
            return
        if k is not None and self.cfg.save and self.driver.last_saved != k:
            self.driver.save(k)
        where = f"after rollout {k} (step {self.progress.step})" if k is not None else "before training started"
        raise Stopped(f"{reason} {where}. {self.resume_hint()}", self.exit.exit_code())

    def _stop_cut(self, k: int, exc: StopRequested) -> None:
        """An exit signal cut rollout ``k`` (``exc`` says how): write the checkpoint of the last
        complete rollout (with rollout k when it was generated but not trained on, so a resumed
        run trains on it) unless the trainer's weights are between two rollouts, then stop."""
        reason, d = self.exit.reason() or "stopped", self.driver
        head = f"{reason} during rollout {k}: {exc}"
        if exc.steps_done:
            raise Stopped(
                f"{head}, after {exc.steps_done} of its optimizer steps: the trainer's weights are between two "
                f"rollouts, which no checkpoint holds, so none was written. {self.resume_hint()}",
                self.exit.exit_code(),
            )
        done = d.last_trained
        if self.cfg.save and done is not None and d.last_saved != done:
            d.save(done)
            head += f"; saved rollout {done} (step {self.progress.step})"
            pending = d.schedule.pending()
            if pending is not None:
                head += f" with rollout {pending.rollout_id}, generated and not trained on yet"
        raise Stopped(f"{head}. {self.resume_hint()}", self.exit.exit_code())

    # -- set-up, resume, teardown -------------------------------------------------------------------
    def _start(self) -> None:
        a, cfg = self.args, self.cfg
        self.owns_ray = init_ray(a.ray_num_cpus or required_cpus(a))
        self.exit.install()  # ray.init sets its own SIGTERM handler (exit at once): take it back
        self.placement = create_placement(a)
        ledger = WeightLedger(cfg.sync)
        if cfg.sft:  # the data source stands in for the rollout client (``loop/sft_data.py``)
            self.client = SftData(a)
        else:
            self.client = RolloutClient(
                a,
                self.placement,
                self.resume_hint,
                rollout_engine=cfg.rollout_engine,
                max_retries=cfg.max_rollout_retries,
            )
        self.group = TrainGroup(a, self.placement)
        validate_world(a, dp_size=self.group.dp_size)
        if ledger.distributed:  # train rank 0 hosts the weight group's store
            ledger.rendezvous = self.group.rendezvous_address()
        self.driver = Driver(cfg, self.group, self.client, ledger, self.progress, self.resume_hint)
        # the driver's waits poll the exit request; its first poll after a signal stops the train
        # ranks before their next step, then aborts the rollout manager's generation. Neither waits
        # for an answer, and the ranks come first: a manager that does not answer (its control
        # thread held by user code) must not cost the grace the checkpoint needs
        self.group.poll = self.client.poll = self.exit.poll
        self.exit.actions = [self.group.request_stop, self.client.abort]

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
        self.driver.resume(read_pending(cfg, step, p.start_rollout, cfg.rollout_batch_size))
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
                shutdown_ray()  # it resets SIGTERM's disposition: exit_request's signal thread takes them
