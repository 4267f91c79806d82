"""The run of ``rl-plugin-train``, start to end, around the rollouts its schedule runs.

Before Ray starts, ``preflight`` checks everything that needs no world and the run takes the
output directory's lock (``run_lock``). Then: start Ray, the placement, the rollout client
(``rl_plugin.ray.rollout_client``), the train group and the weight ledger; resume (``--load``);
the first weight sync; then ``RolloutPieces.run_rollout(k)`` for each rollout, stopping between two
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

from rl_plugin.arguments.embedded import is_embedded
from rl_plugin.arguments.file_contents import check_progress
from rl_plugin.arguments.setup import check_command_line
from rl_plugin.checkpoint.commit import move_checkpoints_aside
from rl_plugin.checkpoint.layout import resume_step, step_dir
from rl_plugin.checkpoint.run_settings import settings_of
from rl_plugin.configs.async_training import stale_drop_warning, staleness_warning
from rl_plugin.configs.engine import validate_engine_installed
from rl_plugin.configs.run import RunConfig, check_world
from rl_plugin.errors import Interrupted, LoopError, Stopped, StopRequested, fail
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.critic_pieces import CriticPieces
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.loop.exit_request import ExitRequest
from rl_plugin.loop.plot import plot_reward_curve
from rl_plugin.loop.preflight import finished_message, is_finished, preflight
from rl_plugin.loop.resume import (
    Progress,
    load_critic_state,
    load_train_state,
    read_pending,
    resume_hint,
    supersede_metrics,
)
from rl_plugin.loop.rollout_pieces import RolloutPieces
from rl_plugin.loop.rows import RowLogger, keep_previous
from rl_plugin.loop.run_lock import RunLock
from rl_plugin.ray.cluster import create_placement, init_ray, required_cpus, shutdown_ray
from rl_plugin.ray.critic_group import make_critic_group
from rl_plugin.ray.rollout_actor import RolloutSetupError
from rl_plugin.ray.rollout_client import RolloutClient
from rl_plugin.ray.train_group import TrainActorError, TrainGroup
from rl_plugin.rollout.source import SFT, make_source
from rl_plugin.weight_sync import WeightLedger


class TrainingRun:
    """``args``: the validated flags. The run checks them as given (``check_command_line``), builds
    the ``RunConfig`` tree once and hands each part its config; ``args`` itself goes on only to the
    rollout manager, for the user's hooks (``rl_plugin.configs.run``)."""

    def __init__(self, args, argv: Optional[Sequence[str]] = None):
        self.args = args  # the user hooks' namespace (and the checks on the flags as given)
        self.argv = list(sys.argv[1:] if argv is None else argv)  # for the resume command in messages
        # the run's settings, once; the user functions they name load after preflight checked them
        self.config = RunConfig.from_args(args, load_user_code=False, embedded=is_embedded(args))
        self.cfg: Optional[LoopConfig] = None  # the loop's view, once the embedded default filled in its paths
        self.progress = Progress()
        self.exit: Optional[ExitRequest] = None  # exit signals and --exit-duration-in-mins
        # what _start starts, in order; _teardown stops whatever of it exists
        self.owns_ray = False
        self.placement = None
        self.client: Optional[RolloutClient] = None  # None under SFT: its source runs here (``self.sft``)
        self.sft = None
        self.group: Optional[TrainGroup] = None
        self.critic: Optional[TrainGroup] = None  # --advantage-estimator ppo: the critic's ranks
        self.pieces: Optional[RolloutPieces] = None
        self.rows: Optional[RowLogger] = None

    def run(self) -> None:
        run, ft = self.config, self.config.fault_tolerance
        # first: the exit signals are blocked in every thread started from now on (exit_request)
        self.exit = ExitRequest(
            handle_signals=ft.exit_signal_handler,
            duration_mins=ft.exit_duration_in_mins,
            will_save=bool(run.checkpoint.save),
            grace_s=ft.exit_signal_grace_s,
        )
        self.exit.install()
        try:
            if run.mode.generates:  # SFT starts no engine
                validate_engine_installed(run.rollout.engine.engine)
            if run.embedded:
                run = self.config = prepare_embedded(self.args, run)
            if run.train.model.hf_checkpoint is None:
                fail(
                    "--prompt-data without --hf-checkpoint",
                    "the loop needs a model to train",
                    "pass --hf-checkpoint DIR (a Hugging Face model directory)",
                )
            self.cfg = LoopConfig.of(run, run_settings=settings_of(run))  # settings: for a resume's note
            self.exit.resume_hint = self.resume_hint
            self._checked_run()
        finally:
            self.exit.restore()

    def _checked_run(self) -> None:
        run, cfg = self.config, self.cfg
        check_command_line(self.args)  # the flags as given: model and data, DP size, files
        point = preflight(run)  # everything else that needs no world: RLArgumentError before Ray starts
        if point is not None and is_finished(run, point.next_rollout):
            print(finished_message(run, point.step), flush=True)
            return
        for warning in (staleness_warning(run), stale_drop_warning(run), run.true_on_policy.note(run)):
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
                for root in (cfg.save, cfg.critic_save):  # PPO: the critic's with the actor's
                    moved = move_checkpoints_aside(root) if root else None
                    if moved is not None:
                        print(f"--overwrite-save: the earlier checkpoints of {root} were moved to {moved}", flush=True)
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
            if is_finished(self.config, progress.start_rollout):
                print(finished_message(self.config, progress.step), flush=True)
                return
            if progress.step == 0:
                keep_previous(cfg.metrics_file)
            if self.client is not None:  # SFT: no rollout manager, no engine to hold the weights
                self.client.read_dataset_state()
                self.pieces.sync_weights()
            self._stop_if_asked(None)  # asked during start-up: nothing trained since the checkpoint
            self.rows = RowLogger(self.config, cfg, progress.start_rollout)
            self.pieces.log_to(self.rows)
            for k in range(progress.start_rollout, cfg.num_rollout):
                try:
                    self.pieces.run_rollout(k)
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
        if k is not None and self.cfg.save and self.pieces.last_saved != k:
            self.pieces.save(k)
        where = f"after rollout {k} (step {self.progress.step})" if k is not None else "before training started"
        raise Stopped(f"{reason} {where}. {self.resume_hint()}", self.exit.exit_code())

    def _stop_cut(self, k: int, exc: StopRequested) -> None:
        """An exit signal cut rollout ``k`` (``exc`` says how): write the checkpoint of the last
        complete rollout (with rollout k when it was generated but not trained on, so a resumed
        run trains on it) unless the trainer's weights are between two rollouts, then stop."""
        reason, d = self.exit.reason() or "stopped", self.pieces
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
        run, cfg = self.config, self.cfg
        self.owns_ray = init_ray(run.cluster.ray_num_cpus or required_cpus(run))
        self.exit.install()  # ray.init sets its own SIGTERM handler (exit at once): take it back
        self.placement = create_placement(run)
        ledger = WeightLedger(cfg.sync)
        if run.mode.source == SFT:  # no rollout manager, no engine: the source runs in this process
            self.sft = make_source(SFT, config=run.rollout, checkpoint_dir=run.train.model.hf_checkpoint)
        else:  # the manager's source, in its actor
            self.client = RolloutClient(run, self.placement, self.resume_hint, hook_args=self.args)
        self.group = TrainGroup(run.with_user_functions().train, self.placement)
        check_world(run, dp_size=self.group.dp_size)
        if ledger.distributed:  # train rank 0 hosts the weight group's store
            ledger.rendezvous = self.group.rendezvous_address()
        critic = None
        self.critic = make_critic_group(run, self.placement)  # PPO: its own bundles, or the actor's when colocated
        if self.critic is not None:
            self.critic.poll = self.exit.poll  # its calls are not cut (critic_pieces): the waits only poll
            critic = CriticPieces(run.critic, self.critic, self.group)
        self.pieces = RolloutPieces(
            cfg, self.group, self.client, ledger, self.progress, self.resume_hint, sft=self.sft, critic=critic
        )
        # the waits poll the exit request; its first poll after a signal stops the train ranks
        # before their next step, then aborts the rollout manager's generation. Neither waits for
        # an answer, and the ranks come first: a manager that does not answer (its control thread
        # held by user code) must not cost the grace the checkpoint needs
        self.group.poll = self.exit.poll
        self.exit.actions = [self.group.request_stop]
        if self.client is not None:  # SFT: no rollout manager
            self.client.poll = self.exit.poll
            self.exit.actions.append(self.client.abort)

    def _resume(self) -> None:
        cfg = self.cfg
        step = resume_step(cfg.load, cfg.ckpt_step) if cfg.load else None
        if self.critic is not None and cfg.critic_load:  # the actor's step, or a given critic's latest
            loaded = load_critic_state(self.critic, cfg.critic_load, step)
            if loaded is not None:
                print(f"critic: loaded {step_dir(cfg.critic_load, loaded)}", flush=True)
        if not cfg.load:
            return
        if step is None:
            print(f"--load {cfg.load}: the directory holds no checkpoint yet, starting from scratch", flush=True)
            return
        meta = load_train_state(self.group, cfg.load, step)
        extra = meta["extra"]
        p = self.progress
        p.step, p.start_rollout = int(meta["step"]), int(extra["rollout_id"])
        p.samples_seen = int(extra.get("samples_seen", 0))
        check_progress(self.config, p.start_rollout, p.step)  # checkpoints without loop_state.json
        if is_finished(self.config, p.start_rollout):
            return
        if self.client is not None:
            self.client.load_state_dict(extra["rollout_state"])
        else:
            self.sft.load_state_dict(extra["rollout_state"])
        self.pieces.resume(read_pending(cfg, step, p.start_rollout, cfg.rollout_batch_size))
        print(f"resumed from {step_dir(cfg.load, step)}: step {p.step}, next rollout {p.start_rollout}", flush=True)
        supersede_metrics(cfg, p.step)

    def _teardown(self) -> None:
        """Kill this run's actors and free its placement (the Ray cluster may outlive the run).
        Best effort: after Ctrl-C the cluster's processes may already be gone."""
        try:
            for group in (self.group, self.critic):
                if group is not None:
                    group.kill()
            if self.client is not None:
                self.client.kill()
            if self.placement is not None:
                self.placement.remove()
        except Exception:  # noqa: BLE001 - never hide the run's own error behind a teardown error
            pass
        finally:
            if self.owns_ray:
                shutdown_ray()  # it resets SIGTERM's disposition: exit_request's signal thread takes them
