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
    return parser


def same_dir(a, b) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def validate(args) -> None:
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
