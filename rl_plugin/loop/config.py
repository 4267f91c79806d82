"""``LoopConfig``: the flags the loop's schedule reads, typed, built once from the parsed flags.

The driver hands ``args`` only to the constructors of what it owns (placement, train group,
rollout manager, metrics logger, preflight); the schedules, the rollout client, resume and the
row logger read this object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rl_plugin.weight_sync import SyncSettings

DEFAULT_OUTPUT_DIR = "outputs/run"


def output_dir_of(args) -> Path:
    """``--output-dir``, or ``outputs/run`` (the embedded default sets its own before this is read)."""
    return Path(args.output_dir or DEFAULT_OUTPUT_DIR)


@dataclass(frozen=True)
class LoopConfig:
    num_rollout: int
    rollout_batch_size: int  # prompt groups per rollout
    train_backend: str
    rollout_engine: str
    advantage_estimator: str
    global_batch_size: Optional[int]  # None: one step per rollout
    docs_per_step: Optional[int]  # --docs-per-step: the ranks plan their steps
    overlapped: bool  # --max-weight-staleness > 0
    sync: SyncSettings
    save: Optional[str]
    save_interval: Optional[int]
    load: Optional[str]
    ckpt_step: Optional[int]  # --ckpt-step: the step of --load to resume (None: the tracker's)
    save_retain: Optional[int]  # --save-retain: keep the newest N checkpoints (None: all)
    save_retain_interval: Optional[int]  # --save-retain-interval: and those after a multiple of K rollouts
    overwrite_save: bool
    eval_interval: Optional[int]
    log_interval: int
    progress_bar: bool
    max_rollout_retries: int
    output_dir: Path
    metrics_file: Path

    @classmethod
    def from_args(cls, args) -> "LoopConfig":
        output_dir = output_dir_of(args)
        return cls(
            num_rollout=int(args.num_rollout),
            rollout_batch_size=int(args.rollout_batch_size),
            train_backend=args.train_backend,
            rollout_engine=args.rollout_engine,
            advantage_estimator=args.advantage_estimator,
            global_batch_size=args.global_batch_size,
            docs_per_step=args.docs_per_step,
            overlapped=args.max_weight_staleness > 0,
            sync=SyncSettings(
                buffer_bytes=args.update_weight_buffer_size,
                transport=args.update_weight_transport,
                check=bool(args.check_weight_sync),
                slots=2 if args.max_weight_staleness > 0 else 1,
            ),
            save=args.save,
            save_interval=args.save_interval,
            load=args.load,
            ckpt_step=args.ckpt_step,
            save_retain=args.save_retain,
            save_retain_interval=args.save_retain_interval,
            overwrite_save=bool(args.overwrite_save),
            eval_interval=args.eval_interval,
            log_interval=int(args.log_interval),
            progress_bar=not args.no_progress_bar,
            max_rollout_retries=int(args.max_rollout_retries),
            output_dir=output_dir,
            metrics_file=Path(args.metrics_file or output_dir / "metrics.jsonl"),
        )

    def eval_due(self, k: int) -> bool:
        """Whether the eval runs after rollout k (every --eval-interval rollouts, and after the last)."""
        return bool(self.eval_interval) and ((k + 1) % self.eval_interval == 0 or k + 1 == self.num_rollout)

    def save_due(self, k: int) -> bool:
        """Whether a checkpoint is written after rollout k (every --save-interval rollouts, and after the last)."""
        return bool(self.save) and (
            (bool(self.save_interval) and (k + 1) % self.save_interval == 0) or k + 1 == self.num_rollout
        )

    def sync_due(self, k: int, ahead: int) -> bool:
        """Whether the train call of rollout k publishes its weights: some later call loads them
        (the eval after rollout k, or the generate of rollout k + 1 + ``ahead``)."""
        return self.eval_due(k) or k + 1 + ahead < self.num_rollout
