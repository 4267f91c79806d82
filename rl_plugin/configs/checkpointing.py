"""CheckpointConfig: where checkpoints go and come from (Megatron-LM's ``--save`` / ``--load`` /
``--save-interval``), which step to resume, which are kept, and the guard against overwriting a
run's. The rules that read the directories themselves (a ``--load`` that does not exist, a
``--save`` that already holds checkpoints) are in ``rl_plugin.arguments.paths``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, Bounds, Declared, flag

GROUP = "checkpointing"


def same_dir(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


@dataclass(frozen=True)
class CheckpointConfig(Declared):
    save: Optional[str] = flag(
        "--save", type=str, default=None, help="Checkpoint directory to save to (Megatron-LM).", **MEGATRON
    )
    load: Optional[str] = flag(
        "--load", type=str, default=None, help="Checkpoint directory to resume from (Megatron-LM).", **MEGATRON
    )
    save_interval: Optional[int] = flag(
        "--save-interval",
        type=int,
        default=None,
        help="Save a checkpoint every N rollouts (Megatron-LM spells it in steps; rl-plugin-train saves between rollouts, so that resume restores the dataset position too), and always after the last rollout.",
        bounds=Bounds(1, "--save-interval 10 (rollouts)"),
        **MEGATRON,
    )
    ckpt_step: Optional[int] = flag(  # the step of --load to resume (None: the tracker's)
        "--ckpt-step",
        type=int,
        default=None,
        group=GROUP,
        help=(
            "Resume from this step's checkpoint in --load instead of the newest one its tracker names (Megatron-LM's "
            "flag), e.g. to go back before a divergence. Saving into the same directory then writes new steps after it."
        ),
    )
    save_retain: Optional[int] = flag(  # keep the newest N checkpoints (None: all)
        "--save-retain",
        type=int,
        default=None,
        group=GROUP,
        help=(
            "Keep only the newest N complete checkpoints in --save (older iter_* directories are deleted after each "
            "save, once the new one is complete); default: keep all. A checkpoint of a 7B model with AdamW is ~84 GB."
        ),
    )
    save_retain_interval: Optional[int] = flag(  # and those after a multiple of K rollouts
        "--save-retain-interval",
        type=int,
        default=None,
        group=GROUP,
        help=(
            "With --save-retain: also keep every checkpoint written after a multiple of K rollouts (counted like "
            "--save-interval), e.g. for evaluating the run's history later."
        ),
    )
    overwrite_save: bool = flag(
        "--overwrite-save",
        action="store_true",
        group=GROUP,
        help=(
            "Start a new run (no --load) in a --save directory that already holds checkpoints. Without it "
            "rl-plugin-train refuses, so a forgotten --load cannot silently overwrite a run and move its resume "
            "point back. The earlier checkpoints are moved aside into DIR/overwritten_<N>/, not deleted."
        ),
    )

    def check(self, run) -> None:
        if self.save_interval is not None and self.save is None:
            fail(
                "--save-interval without --save",
                "there is no checkpoint directory, so the interval would be silently ignored",
                "add --save DIR, or drop --save-interval",
            )
        self._check_overwrite(run)
        self._check_retention(run)

    def _check_overwrite(self, run) -> None:
        if not self.overwrite_save:
            return
        if self.save is None:
            fail(
                "--overwrite-save without --save",
                "there is no checkpoint directory to overwrite",
                "add --save DIR, or drop --overwrite-save",
            )
        if same_dir(self.save, self.load):
            fail(
                "--overwrite-save with --load and --save the same directory",
                "--load resumes the run in that directory, --overwrite-save would start over in it",
                "drop --overwrite-save to resume, or drop --load to start over",
            )

    def _check_retention(self, run) -> None:
        n, k = self.save_retain, self.save_retain_interval
        if n is not None and n < 1:
            fail(
                "--save-retain", f"must be >= 1 (got {n}): the newest checkpoint is the resume point", "keep at least 1"
            )
        if k is not None and (k < 1 or n is None):
            fail(
                "--save-retain-interval",
                f"needs --save-retain and a value >= 1 (got {k})",
                "pass --save-retain N with it, or drop it (without --save-retain every checkpoint is kept)",
            )
        load = self.load
        if self.ckpt_step is not None and (self.ckpt_step < 0 or load is None):
            fail(
                "--ckpt-step",
                f"names a step of the --load directory and must be >= 0 (got {self.ckpt_step}, --load {load})",
                "pass --load DIR with it, or drop it to resume from the newest checkpoint",
            )
