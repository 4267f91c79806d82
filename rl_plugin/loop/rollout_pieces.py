"""``RolloutPieces``: the pieces of a rollout, over the objects the run started.

The schedule drives (``loop/schedule.py``); this object is what it drives: the phases of one
rollout (the ``RolloutLoop`` protocol), each over the actors and records the run started. It
holds the train group (one actor per rank), the rollout client (the manager actor, its
engines, retries), the weight ledger (which weights the engines hold), the run's progress and the
row logger, and runs one schedule (``loop/schedule.py``) over them: ``SyncSchedule`` (default),
``OverlappedSchedule`` (``--max-weight-staleness 1``), ``FullyAsyncSchedule`` (``--fully-async``) or
``SftSchedule`` (``--loss-type sft_loss``: no rollout client, no engine, no sync; its source,
``rl_plugin.rollout.sft_source.SftSource``, runs in this process). The schedule calls the named pieces below
(the ``RolloutLoop`` protocol); per rollout k::

    data    = generate(k)                  # the manager loads the newest published weights first
    reports = train_rollout(data, sync)    # advantages, the plan of steps, the steps; rank 0 publishes
                                           # (PPO: the critic's values first, its value steps after)
    finish_rollout(k, ...)                 # rows, checkpoint, eval when due

The weight sync rides on those calls (``rl_plugin.weight_sync``): only the first sync of a run
(or of a fresh rollout manager) is a call of its own (``sync_weights``). Starting Ray and the
actors, resume, stopping and the run's errors are the run's (``loop/run.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from rl_plugin.checkpoint.commit import remove_partial
from rl_plugin.checkpoint.disk_space import directory_bytes, disk_full_message
from rl_plugin.checkpoint.layout import latest_step, partial_dir, step_dir
from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.configs.mode import Mode
from rl_plugin.errors import LoopError, StopRequested, WeightSyncError
from rl_plugin.loop.advantages import ppo_base_batch, rollout_batch
from rl_plugin.loop.ci_checks import check_actor_ref, check_logprobs, sync_failure
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.critic_pieces import CriticPieces, merge_reports, step_samples
from rl_plugin.loop.fully_async_schedule import FullyAsyncSchedule
from rl_plugin.loop.overlapped_schedule import OverlappedSchedule
from rl_plugin.loop.resume import Progress, save_checkpoint, save_critic_checkpoint
from rl_plugin.loop.rows import RowLogger
from rl_plugin.loop.schedule import Schedule
from rl_plugin.loop.sft_schedule import SftSchedule
from rl_plugin.loop.sync_schedule import SyncSchedule
from rl_plugin.loss import StepBatch
from rl_plugin.ray.rollout_client import RolloutClient
from rl_plugin.ray.train_group import TrainGroup
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.rollout.sft_source import SftSource
from rl_plugin.step_plan import RankPlan, plan_global_batch_steps, split_rollout_for_dp
from rl_plugin.weight_sync import WeightLedger

# the schedule of each mode (``rl_plugin.configs.mode``): each mode's order of phases, its own file
SCHEDULES = {
    Mode.SYNC: SyncSchedule,
    Mode.OVERLAPPED: OverlappedSchedule,
    Mode.FULLY_ASYNC: FullyAsyncSchedule,
    Mode.SFT: SftSchedule,
}


class RolloutPieces:
    """The ``RolloutLoop`` a schedule calls (and the run's handle on the schedule): it decides no
    order itself, the schedule does."""

    def __init__(
        self,
        cfg: LoopConfig,
        group: TrainGroup,
        client: Optional[RolloutClient],
        ledger: WeightLedger,
        progress: Progress,
        resume_hint: Callable[[], str],
        sft: Optional[SftSource] = None,
        critic: Optional[CriticPieces] = None,
    ):
        """``client``: the rollout manager's (None under SFT, whose ``sft`` source runs here);
        ``critic``: PPO's critic (``--advantage-estimator ppo``; ``loop/critic_pieces.py``)."""
        self.cfg, self.group, self.client, self.ledger, self.sft = cfg, group, client, ledger, sft
        self.critic = critic
        self.progress = progress  # shared with the run: resume sets it, the rows advance it
        self.resume_hint = resume_hint
        self.rows: Optional[RowLogger] = None  # opened once the first sync is done (``log_to``)
        # the last rollout whose steps are done (logged) and the last one saved, in this run: what
        # the run saves when an exit signal cuts a rollout (``loop/run.py``)
        self.last_trained: Optional[int] = None
        self.last_saved: Optional[int] = None
        self.trained = 0  # rollouts whose train call completed in this run (the trainer's weight version counts them)
        if client is not None:
            client.on_fresh_engines = ledger.fresh_engines
            client.on_restart = self.sync_weights
        self.schedule: Schedule = SCHEDULES[cfg.mode](self, cfg)

    # -- what the run calls ---------------------------------------------------------------------
    def log_to(self, rows: RowLogger) -> None:
        self.rows = rows

    def resume(self, pending: Optional[PendingRollout]) -> None:
        """A resumed checkpoint's rollout generated ahead (or None), handed to the schedule."""
        self.schedule.resume(pending)

    def run_rollout(self, k: int) -> None:
        self.schedule.run_rollout(k)

    def save(self, k: int) -> None:
        """The checkpoint after rollout k (with the rollout the schedule generated ahead, if any).
        A save that fails for lack of space says so and removes its ``.partial`` (never a resume
        point), so the disk keeps the space it had."""
        cfg, step = self.cfg, self.progress.step
        try:
            if self.critic is not None and cfg.critic_save:  # first: the actor's commit is the resume point
                save_critic_checkpoint(
                    cfg.critic_save, self.critic.critic, self.progress, k, cfg.save_retain, cfg.save_retain_interval
                )
            save_checkpoint(cfg, self.group, self.progress, k, self.dataset_state(), self.schedule.pending())
        except (OSError, RuntimeError) as exc:  # a rank that raised (TrainActorError), the driver's own writes
            staging, last = partial_dir(cfg.save, step), latest_step(cfg.save)
            remove_partial(staging)
            full = disk_full_message(
                cfg.save, str(exc), directory_bytes(step_dir(cfg.save, last)) if last is not None else None
            )
            if full is None:
                raise
            raise LoopError(
                f"saving step {step} failed: {full}. The unfinished save {staging} was removed. "
                f"Fix: free space there or point --save at a larger disk. {self.resume_hint()}"
            ) from None
        self.last_saved = k

    def dataset_state(self):
        """The data position a checkpoint written now saves: the manager's after its last rollout
        (kept by the client), or the SFT source's."""
        return self.sft.state_dict() if self.sft is not None else self.client.dataset_state

    def weights_version(self) -> int:
        """The trainer's weight version: the rollouts trained on (rollout k trains version k), the
        resumed ones counted by the start rollout."""
        return self.progress.start_rollout + self.trained

    def sync_weights(self) -> None:
        """A sync as a call of its own: at the start (the trainer's weights, maybe a resumed
        checkpoint's, into the engines) and into a restarted rollout manager. Train rank 0
        publishes its export; its handle goes to the manager as an ObjectRef, so the load starts
        as soon as rank 0 published."""
        g = self.group
        request = self.ledger.request(self.client.engine_node_ids)
        export = g.submit_export_weight_buckets(request)
        announced = self.ledger.announce(request)  # distributed: the engines receive while rank 0 publishes
        update = self.client.submit_update(export.refs[0] if announced is None else announced, self.weights_version())
        handle = export.wait()[0]  # a failed rank is named here, before the update's error
        if handle.error is not None:  # distributed: the engines died or stalled mid-sync
            return self._replace_engines(handle)
        load = self.client.wait_update(update)
        del export, update  # the buckets are freed once no one holds their handles
        if load is not None:
            self.ledger.synced_fully(handle, load)

    # -- the pieces a schedule runs (``RolloutLoop``) -------------------------------------------------
    def generate(self, k: int) -> RolloutData:
        """Rollout ``k`` (the newest weights loaded first); a rollout manager that dies meanwhile is
        replaced and the rollout retried (the retry yields the samples the first try would)."""
        return self.wait_generate(k, None)

    def submit_generate(self, k: int):
        """Rollout k's generate, handed the newest published weights to load first."""
        self._offload_train()
        return self.client.submit_generate(k, self.ledger.give())

    def _offload_train(self) -> None:
        """``--offload-train`` (colocated): the ranks' training state to host memory before the
        engines wake to generate; the next train call brings it back (``TrainActor.offload_train``).
        Once per generation, a no-op on ranks already offloaded."""
        if self.cfg.offload_train:
            self.group.offload_train()
            if self.critic is not None:  # colocated, the critic's ranks share the engines' devices too
                self.critic.critic.offload_train()

    def wait_generate(self, k: int, in_flight) -> RolloutData:
        """The answer of ``in_flight`` (or of a generate submitted now, when None), resubmitted to
        a fresh manager when the actor died; its dataset position kept, its weight load checked."""
        data = self.client.retrying("generate", k, lambda: self.submit_generate(k), first=in_flight)
        self.client.answered(data)
        self._check_load(k, data)
        return data

    def _check_load(self, k: int, data: RolloutData) -> None:
        """The weight load rollout k's generate did first, checked by the ledger (fingerprints
        under --check-weight-sync / --ci-test: a mismatch names the rollout)."""
        load, data.weight_load = data.weight_load, None
        try:
            self.ledger.loaded(load)
        except WeightSyncError as exc:
            raise sync_failure(k, exc, self.cfg.ci.ci_test) from None

    def take(self, k: int) -> RolloutData:
        """Fully async: rollout k from the rollout manager's buffer (the newest published weights
        loaded first); a manager that died is replaced and its worker restarted by the retry."""
        data = self.client.retrying("take", k, lambda: self.client.submit_generate(k, self.ledger.give()))
        self.client.answered(data)
        self._check_load(k, data)
        return data

    def manager_restarts(self) -> int:
        return self.client.restarts

    def local_source(self) -> Optional[SftSource]:
        """The mode's rollout source when it runs in this process (SFT's data), else None."""
        return self.sft

    def train_rollout(
        self, data: RolloutData, sync: bool = False, batch: Optional[StepBatch] = None
    ) -> List[Dict[str, Any]]:
        """Rollout ``data``'s optimizer steps on every rank (``batch``: the step batch the schedule
        built; default the advantages of ``data``'s rewards, ``advantages.rollout_batch``); with
        ``sync``, the ranks then export and rank 0 publishes the new weights in the same call (the
        ledger gives them to the next manager call). Returns the step reports. A train call that an
        exit signal stopped before its last step raises ``StopRequested`` (nothing published).
        PPO (a critic; SFT, the one schedule that builds its own batch, is refused with it): the
        critic's advantages (``_train_ppo``)."""
        if self.critic is not None:
            return self._train_ppo(data, sync)
        if batch is None:
            batch = rollout_batch(data, self.cfg.advantage_estimator)
        return self._train_actor(data, sync, batch)

    def _train_ppo(self, data: RolloutData, sync: bool) -> List[Dict[str, Any]]:
        """PPO (``loop/critic_pieces.py``): the critic's values (and, with --kl-coef, the actor's
        old / reference log-probs) first, the advantages, the actor's steps on them (none during
        the first --num-critic-only-steps rollouts: the actor's weights, optimizer and engines stay
        as they are), then the critic's value steps over the same plan. One row per step."""
        c, k = self.critic, self.weights_version()  # the rollout's index: one train call per rollout
        batch, stats = c.advantages(ppo_base_batch(data), data.rewards)
        actor_reports: List[Dict[str, Any]] = []
        if c.actor_trains(k):
            actor_reports = self._train_actor(data, sync, batch)
        else:
            self.trained += 1  # the version counts rollouts (resume's start rollout counts this one too)
        plans = self._plans(batch, data.num_groups, c.critic)
        return merge_reports(actor_reports, c.train(plans), stats, step_samples(c.critic, plans))

    def _train_actor(self, data: RolloutData, sync: bool, batch: StepBatch) -> List[Dict[str, Any]]:
        """The actor's steps on ``batch`` (``train_rollout``), then the publish when ``sync``."""
        g, plans = self.group, self._plans(batch, data.num_groups)
        request = self.ledger.request(self.client.engine_node_ids) if sync else None  # every rank exports
        announced = self.ledger.announce(request) if request is not None else None
        if announced is None:
            reports, handle = g.train_rollout(plans, publish=request)[0]
            _check_complete(reports, plans[0])
            self.trained += 1
            self.ledger.published(handle)
            return reports
        # distributed: the manager receives while rank 0 broadcasts at the end of its train call
        trained = g.submit_train_rollout(plans, publish=request)
        update = self.client.submit_update(announced, self.weights_version() + 1)
        reports, handle = trained.wait()[0]
        _check_complete(reports, plans[0])  # stopped: no broadcast comes; the teardown ends the update
        self.trained += 1
        if handle.error is not None:  # the engines died or stalled mid-sync: the steps stand
            self._replace_engines(handle)
            return reports
        load = self.client.wait_update(update)
        if load is not None:
            self.ledger.loaded_while_published(handle, load)
        return reports

    def _replace_engines(self, failed) -> None:
        """A distributed sync that did not complete (``weight_sync.distributed``: a member died or
        stalled past the sync's deadline): the engines' weights are unknown, so the rollout
        manager and its engines are replaced and fully synced, as when one dies (the old load
        ends with them; ``--max-rollout-retries`` counts it)."""
        self.ledger.failed(failed)
        self.client.restart("the weight sync", WeightSyncError(failed.error))

    def _plans(self, batch: StepBatch, num_groups: int, group: Optional[TrainGroup] = None) -> List[RankPlan]:
        """Each rank's plan of optimizer steps of ``batch`` (``rl_plugin.step_plan``) on ``group``
        (default: the actor's; PPO's critic steps over the same global batches on its own ranks)."""
        cfg, g = self.cfg, group or self.group
        if cfg.docs_per_step is not None:  # planned by the ranks: collective over DP
            shares = split_rollout_for_dp(batch, g.dp_size)
            return g.plan_docs_steps([shares[g.dp_rank(r)] for r in range(g.world_size)], num_groups)
        by_dp = plan_global_batch_steps(
            batch, global_batch_size=cfg.global_batch_size or batch.num_samples, dp_size=g.dp_size
        )
        return [by_dp[g.dp_rank(r)] for r in range(g.world_size)]

    def sync_timings(self) -> Dict[str, float]:
        return self.ledger.timings()

    def log_steps(
        self,
        k: int,
        data: RolloutData,
        reports: List[Dict[str, Any]],
        timings: Dict[str, float],
        t0: float,
        staleness: Optional[int],
    ) -> None:
        self.rows.log_steps(self.progress, k, data, reports, timings, t0, staleness)
        self.last_trained = k
        check_logprobs(k, reports, self.cfg.ci.logprob_abs_diff_threshold)  # --ci-test: after the rows are written
        check_actor_ref(k, reports, None if self.cfg.load else self.cfg.ci.actor_ref_tolerance)

    def finish_rollout(
        self,
        k: int,
        data: RolloutData,
        reports: List[Dict[str, Any]],
        timings: Dict[str, float],
        t0: float,
        staleness: Optional[int] = None,
        evaluate: Optional[Callable[[int], Dict[str, float]]] = None,
    ) -> None:
        """Log rollout k's steps, then checkpoint and evaluate when due (``evaluate``: the schedule's
        own eval; default the rollout manager's held-out rollout)."""
        cfg = self.cfg
        self.log_steps(k, data, reports, timings, t0, staleness)
        if cfg.save_due(k):
            self.save(k)
        elif cfg.hf_export_due(k):  # --save-hf without --save: the final model, never dropped
            self.group.save_hf()
        if cfg.eval_due(k):
            self.rows.log_eval(self.progress.step, k, (evaluate or self._evaluate)(k))
        self.rows.advance(data, timings, self.progress.step)

    def _evaluate(self, k: int) -> Dict[str, float]:
        """The eval after rollout k, on the weights after its steps (loaded first when not yet)."""
        self._offload_train()
        ev = self.client.retrying("evaluate", k, lambda: self.client.submit_evaluate(k, self.ledger.give()))
        self.ledger.loaded(ev.pop("weight_load", None))
        return ev

    def eval_nll(self, batch: StepBatch) -> Tuple[float, float]:
        """``batch``'s NLL summed over its trained tokens, and their count: each DP rank scores its
        share with a forward pass (``TrainActor.eval_nll``)."""
        g = self.group
        by_dp = plan_global_batch_steps(batch, global_batch_size=batch.num_samples, dp_size=g.dp_size)
        sums = g.eval_nll([by_dp[g.dp_rank(r)].batch for r in range(g.world_size)])
        first = {g.dp_rank(r): r for r in reversed(range(g.world_size))}  # one rank per DP share
        return sum(sums[r][0] for r in first.values()), sum(sums[r][1] for r in first.values())


def _check_complete(reports: List[Dict[str, Any]], plan: RankPlan) -> None:
    """``StopRequested`` when the ranks stopped (an exit signal) before the plan's last step."""
    planned = len(plan.step_bounds)
    if len(reports) < planned:
        raise StopRequested(
            f"the train call stopped before its optimizer step {len(reports) + 1} of {planned}",
            steps_done=len(reports),
        )
