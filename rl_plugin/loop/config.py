"""``LoopConfig``: the flags the loop's schedule reads, typed, built once from the parsed flags.

The driver hands ``args`` only to the constructors of what it owns (placement, train group,
rollout manager, metrics logger, preflight); the schedules, the rollout client, resume and the
row logger read this object. It declares no flag: each field reads one declared by a config below
(``same_as``), a nested one (``SyncSettings``), or a value derived from the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

from rl_plugin.configs import BatchingConfig, EngineConfig, RolloutConfig, TrainConfig
from rl_plugin.configs.async_training import AsyncConfig
from rl_plugin.configs.checkpointing import CheckpointConfig as Ckpt
from rl_plugin.configs.colocation import ColocationConfig
from rl_plugin.configs.fault_tolerance import FaultToleranceConfig
from rl_plugin.configs.logging import LoggingConfig
from rl_plugin.flags import Declared, derived, nested, runtime, same_as
from rl_plugin.loss_config import LossConfig
from rl_plugin.rollout.async_producer import AsyncSettings
from rl_plugin.weight_sync import SyncSettings

DEFAULT_OUTPUT_DIR = "outputs/run"


def output_dir_of(args) -> Path:
    """``--output-dir``, or ``outputs/run`` (the embedded default sets its own before this is read)."""
    return Path(args.output_dir or DEFAULT_OUTPUT_DIR)


def _metrics_file(args) -> Path:
    return Path(args.metrics_file or output_dir_of(args) / "metrics.jsonl")


@dataclass(frozen=True)
class LoopConfig(Declared):
    num_rollout: Optional[int] = same_as(RolloutConfig, "num_rollout")
    rollout_batch_size: Optional[int] = same_as(RolloutConfig, "rollout_batch_size")  # prompt groups per rollout
    train_backend: str = same_as(TrainConfig, "train_backend")
    rollout_engine: str = same_as(EngineConfig, "engine")
    advantage_estimator: str = same_as(LossConfig, "advantage_estimator")
    global_batch_size: Optional[int] = same_as(BatchingConfig, "global_batch_size")  # None: one step per rollout
    docs_per_step: Optional[int] = same_as(
        BatchingConfig, "docs_per_step"
    )  # --docs-per-step: the ranks plan their steps
    sft: bool = derived(lambda args: args.loss_type == "sft_loss", False)  # --loss-type sft_loss: the SFT schedule
    offload_train: bool = same_as(ColocationConfig, "offload_train")  # the driver offloads before each generation
    overlapped: bool = derived(lambda args: args.max_weight_staleness > 0, False)  # --max-weight-staleness > 0
    fully_async: bool = same_as(AsyncConfig, "fully_async")
    # --fully-async: what the rollout manager's worker reads (buffer, concurrency, staleness, pause)
    async_settings: Optional[AsyncSettings] = derived(lambda a: _async_settings(a) if a.fully_async else None, None)
    update_weights_interval: int = same_as(AsyncConfig, "update_weights_interval")
    sync: SyncSettings = nested(SyncSettings)
    save: Optional[str] = same_as(Ckpt, "save")
    save_interval: Optional[int] = same_as(Ckpt, "save_interval")
    load: Optional[str] = same_as(Ckpt, "load")
    ckpt_step: Optional[int] = same_as(Ckpt, "ckpt_step")
    save_retain: Optional[int] = same_as(Ckpt, "save_retain")
    save_retain_interval: Optional[int] = same_as(Ckpt, "save_retain_interval")
    overwrite_save: bool = same_as(Ckpt, "overwrite_save")
    # --save-hf (or, with LoRA, --save-hf-merged): a Hugging Face directory at every save, or at the end without --save
    hf_export: bool = derived(lambda a: bool(a.save_hf or (a.lora_rank and a.save_hf_merged)), False)
    eval_interval: Optional[int] = same_as(RolloutConfig, "eval_interval")
    log_interval: int = same_as(LoggingConfig, "log_interval")
    progress_bar: bool = derived(lambda args: not args.no_progress_bar, True)
    max_rollout_retries: int = same_as(FaultToleranceConfig, "max_rollout_retries")
    output_dir: Path = derived(output_dir_of, Path(DEFAULT_OUTPUT_DIR))
    metrics_file: Path = derived(_metrics_file, Path(DEFAULT_OUTPUT_DIR) / "metrics.jsonl")
    # loop_state.json's "settings" (rl_plugin.checkpoint.run_settings.settings_of), passed by the run
    run_settings: Tuple[Tuple[str, Any], ...] = runtime(())

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


def _async_settings(args) -> AsyncSettings:
    """The fully-async worker's settings (``--fully-async`` and its flags), read once here."""
    return AsyncSettings(
        max_concurrent=args.async_max_concurrent_samples,
        granularity=args.rollout_submission_granularity,
        capacity_factor=float(args.async_data_buffer_capacity_factor),
        max_staleness=int(args.max_weight_staleness),
        handler=args.async_unused_samples_handler,
        pause_mode=args.pause_generation_mode,
    )
