"""``LoopConfig``: what the loop's schedule reads, typed, a view of the run config built once.

The run (``loop/run.py``) builds the ``RunConfig`` tree once from the parsed flags and hands each
part what it owns (placement, train group, rollout client, metrics logger, preflight); the
schedules, the driver, resume and the row logger read this object. It declares no flag: every
field is read off the tree (``LoopConfig.of``), the run's mode included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from rl_plugin.configs.async_training import AsyncConfig
from rl_plugin.configs.ci_checks import CiChecks
from rl_plugin.configs.custom_generation import steps_global_batch_size
from rl_plugin.configs.mode import Mode
from rl_plugin.configs.run import RunConfig
from rl_plugin.weight_sync import SyncSettings


@dataclass(frozen=True)
class LoopConfig:
    """Every field is read off the run config by ``of`` (no default of its own: one per setting)."""

    mode: Mode  # which schedule runs (``rollout_pieces.SCHEDULES``) and what it needs
    num_rollout: Optional[int]
    rollout_batch_size: Optional[int]  # prompt groups per rollout
    train_backend: str
    rollout_engine: str
    advantage_estimator: str
    # None: one step per rollout (also an agent run's --global-batch-size of the rollout's nominal size)
    global_batch_size: Optional[int]
    docs_per_step: Optional[int]  # --docs-per-step: the ranks plan their steps
    offload_train: bool  # the driver offloads before each generation
    # --fully-async: what the rollout manager's worker reads (buffer, concurrency, staleness, pause)
    async_settings: Optional[AsyncConfig]
    update_weights_interval: int
    sync: SyncSettings
    ci: CiChecks  # --ci-test: the checks at each rollout (loop/ci_checks.py)
    save: Optional[str]
    save_interval: Optional[int]
    load: Optional[str]
    ckpt_step: Optional[int]
    save_retain: Optional[int]
    save_retain_interval: Optional[int]
    overwrite_save: bool
    # --save-hf (or, with LoRA, --save-hf-merged): a Hugging Face directory at every save, or at the end without --save
    hf_export: bool
    eval_interval: Optional[int]
    log_interval: int
    progress_bar: bool
    max_rollout_retries: int
    output_dir: Path
    metrics_file: Path
    # --advantage-estimator ppo: the run's CriticConfig (loop/critic_pieces.py) and its checkpoint dirs; else None
    critic: Optional[Any]
    critic_save: Optional[str]
    critic_load: Optional[str]
    # loop_state.json's "settings" (rl_plugin.checkpoint.run_settings.settings_of), passed by the run
    run_settings: Tuple[Tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, run: RunConfig, **given) -> "LoopConfig":
        """The loop's view of ``run`` (``given``: fields set by hand, e.g. ``run_settings``)."""
        ckpt, train = run.checkpoint, run.train
        values = dict(
            mode=run.mode,
            num_rollout=run.rollout.num_rollout,
            rollout_batch_size=run.rollout.rollout_batch_size,
            train_backend=train.train_backend,
            rollout_engine=run.rollout.engine.engine,
            advantage_estimator=train.loss.advantage_estimator,
            global_batch_size=steps_global_batch_size(run),
            docs_per_step=train.batching.docs_per_step,
            offload_train=run.rollout.engine.colocation.offload_train,
            async_settings=run.async_training if run.mode is Mode.FULLY_ASYNC else None,
            update_weights_interval=run.async_training.update_weights_interval,
            sync=run.sync,
            ci=run.ci,
            save=ckpt.save,
            save_interval=ckpt.save_interval,
            load=ckpt.load,
            ckpt_step=ckpt.ckpt_step,
            save_retain=ckpt.save_retain,
            save_retain_interval=ckpt.save_retain_interval,
            overwrite_save=ckpt.overwrite_save,
            hf_export=bool(train.model.save_hf or (train.lora.lora_rank and train.lora.save_hf_merged)),
            eval_interval=run.rollout.eval_interval,
            log_interval=run.logging.log_interval,
            progress_bar=not run.logging.no_progress_bar,
            max_rollout_retries=run.fault_tolerance.max_rollout_retries,
            output_dir=run.output_dir,
            metrics_file=run.metrics_file,
            critic=run.critic if run.critic.enabled else None,
            critic_save=run.critic.save_dir(run) if run.critic.enabled else None,
            critic_load=run.critic.load_dir(run) if run.critic.enabled else None,
        )
        values.update(given)
        return cls(**values)

    @classmethod
    def from_args(cls, args, **given) -> "LoopConfig":
        """``of`` the tree of parsed flags (for tests and tools; the run builds its tree once)."""
        return cls.of(RunConfig.from_args(args), **given)

    def eval_due(self, k: int) -> bool:
        """Whether the eval runs after rollout k (every --eval-interval rollouts, and after the last)."""
        return bool(self.eval_interval) and ((k + 1) % self.eval_interval == 0 or k + 1 == self.num_rollout)

    def save_due(self, k: int) -> bool:
        """Whether a checkpoint is written after rollout k (every --save-interval rollouts, and after the last)."""
        return bool(self.save) and (
            (bool(self.save_interval) and (k + 1) % self.save_interval == 0) or k + 1 == self.num_rollout
        )

    def hf_export_due(self, k: int) -> bool:
        """Whether the Hugging Face directory alone is written after rollout k: the last rollout of a
        run with --save-hf and no --save (with --save, every checkpoint writes it)."""
        return self.hf_export and not self.save and k + 1 == self.num_rollout

    def sync_due(self, k: int, ahead: int) -> bool:
        """Whether the train call of rollout k publishes its weights: some later call loads them
        (the eval after rollout k, or the generate of rollout k + 1 + ``ahead``)."""
        return self.eval_due(k) or k + 1 + ahead < self.num_rollout
