"""The flag defaults of the embedded default run, and the two-pass parse that applies them.

``rl-plugin-train`` with no ``--prompt-data`` runs the embedded task (``rl_plugin.loop.embedded``
builds its model and data). Its rollout and optimizer defaults live here, at the bottom layer, so
``python -m rl_plugin.arguments`` resolves and checks a command line exactly as the trainer will.
Any flag given explicitly wins.
"""

from __future__ import annotations

from typing import List, Optional

from rl_plugin.arguments import build_parser, validate_rl_args

EMBEDDED_TASK_DIGITS = 3  # the digit-copy task copies this many digits (+ <eos>)

# argparse dests -> defaults of the embedded run. Tuned on a 2-core CPU (benchmarks/embedded_default.py).
EMBEDDED_DEFAULTS = dict(
    rollout_batch_size=16,
    n_samples_per_prompt=8,
    rollout_max_response_len=EMBEDDED_TASK_DIGITS + 1,
    num_rollout=300,
    micro_batch_size=128,
    lr=3e-3,
    eps_clip_high=0.28,
    rm_type="digit_match",
    eval_interval=25,
    n_samples_per_eval=1,
    log_interval=10,  # 300 one-step rollouts: a summary line every 10 keeps the terminal readable
)


def parse_train_flags(argv: Optional[List[str]] = None, *, prog: str = "rl-plugin-train"):
    """Parse and validate (phase 1) a trainer command line, with the embedded defaults when it
    names no ``--prompt-data``."""
    parser = build_parser(prog=prog)
    first = parser.parse_args(argv)
    if first.prompt_data is None:  # the embedded default: its own defaults, explicit flags win
        defaults = dict(EMBEDDED_DEFAULTS)
        if first.custom_rm_path is not None:
            defaults.pop("rm_type")  # the user's reward replaces the built-in one
        parser.set_defaults(**defaults)
        first = parser.parse_args(argv)
    return validate_rl_args(first)
