"""The command line's checks beyond the configs' rules, on the flags as given: what
``python -m rl_plugin.arguments`` and the trainer's first second check before the typed run config
goes anywhere (the trainer's own checks of the built config are ``rl_plugin.loop.preflight``).

``check_command_line(args)``: a model and data that go together (``embedded.check_model_and_data``),
the layout flags nothing reads (warnings, ``unread_flags.check_layout_flags``), the data-parallel
rules for the DP size the cluster flags imply (``validate_world``), and the files the flags name
(``paths.validate_paths``; ``files=False`` skips them, for a machine without the job's files).
"""

from __future__ import annotations

from rl_plugin.arguments import run_config_of, validate_world
from rl_plugin.arguments.embedded import check_model_and_data
from rl_plugin.arguments.paths import validate_paths
from rl_plugin.arguments.unread_flags import check_layout_flags


def check_command_line(args, *, files: bool = True) -> None:
    """Raise ``RLArgumentError`` (exit 2) on the first problem; warnings go to stderr."""
    check_model_and_data(args)
    check_layout_flags(args)
    validate_world(args, dp_size=run_config_of(args).planned_dp_size)
    if files:
        validate_paths(args)
