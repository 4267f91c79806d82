"""Flags of checkpoint safety: what happens when ``--save`` already holds a run's checkpoints.

``--save``, ``--load`` and ``--save-interval`` are Megatron-LM's (``megatron_compat``). The rules
that read the directories themselves (a ``--load`` that does not exist, a ``--save`` that already
holds checkpoints) are in ``rl_plugin.arguments.paths``.
"""

from __future__ import annotations

import os

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group("checkpoint safety", "Guards against overwriting a run's checkpoints by mistake.")
    add_flag(
        g,
        "--overwrite-save",
        action="store_true",
        help=(
            "Start a new run (no --load) in a --save directory that already holds checkpoints. Without it "
            "rl-plugin-train refuses, so a forgotten --load cannot silently overwrite a run and move its resume "
            "point back. The earlier checkpoints are moved aside into DIR/overwritten_<N>/, not deleted."
        ),
    )
    add_flag(
        g,
        "--save-retain",
        type=int,
        default=None,
        help=(
            "Keep only the newest N complete checkpoints in --save (older iter_* directories are deleted after each "
            "save, once the new one is complete); default: keep all. A checkpoint of a 7B model with AdamW is ~84 GB."
        ),
    )
    add_flag(
        g,
        "--save-retain-interval",
        type=int,
        default=None,
        help=(
            "With --save-retain: also keep every checkpoint written after a multiple of K rollouts (counted like "
            "--save-interval), e.g. for evaluating the run's history later."
        ),
    )
    add_flag(
        g,
        "--ckpt-step",
        type=int,
        default=None,
        help=(
            "Resume from this step's checkpoint in --load instead of the newest one its tracker names (Megatron-LM's "
            "flag), e.g. to go back before a divergence. Saving into the same directory then writes new steps after it."
        ),
    )
    return parser


def same_dir(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def validate(args) -> None:
    _overwrite(args)
    _retention(args)


def _overwrite(args) -> None:
    if not args.overwrite_save:
        return
    if getattr(args, "save", None) is None:
        fail(
            "--overwrite-save without --save",
            "there is no checkpoint directory to overwrite",
            "add --save DIR, or drop --overwrite-save",
        )
    if same_dir(args.save, getattr(args, "load", None)):
        fail(
            "--overwrite-save with --load and --save the same directory",
            "--load resumes the run in that directory, --overwrite-save would start over in it",
            "drop --overwrite-save to resume, or drop --load to start over",
        )


def _retention(args) -> None:
    n, k = args.save_retain, args.save_retain_interval
    if n is not None and n < 1:
        fail("--save-retain", f"must be >= 1 (got {n}): the newest checkpoint is the resume point", "keep at least 1")
    if k is not None and (k < 1 or n is None):
        fail(
            "--save-retain-interval",
            f"needs --save-retain and a value >= 1 (got {k})",
            "pass --save-retain N with it, or drop it (without --save-retain every checkpoint is kept)",
        )
    if args.ckpt_step is not None and (args.ckpt_step < 0 or getattr(args, "load", None) is None):
        fail(
            "--ckpt-step",
            f"names a step of the --load directory and must be >= 0 (got {args.ckpt_step}, --load {getattr(args, 'load', None)})",
            "pass --load DIR with it, or drop it to resume from the newest checkpoint",
        )
