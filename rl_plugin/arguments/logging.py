"""Flags of what the loop writes: metrics JSONL, TensorBoard, Weights & Biases, reward curve."""

from __future__ import annotations

import importlib.util

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group("logging", "Where the loop's metrics go.")
    add_flag(
        g,
        "--output-dir",
        type=str,
        default=None,
        help="Directory for the run's metrics, reward curve and (with the embedded default) checkpoints. Default: outputs/embedded_<backend> for the embedded task, else outputs/run.",
    )
    add_flag(
        g,
        "--metrics-file",
        type=str,
        default=None,
        help="JSONL file with one line per train step (and per evaluation). Appended to, never truncated, so a resumed run keeps the lines already written. Default: <output-dir>/metrics.jsonl.",
    )
    add_flag(
        g, "--tensorboard-dir", type=str, default=None, help="Write the per-step metrics as TensorBoard scalars here."
    )
    add_flag(
        g,
        "--use-wandb",
        action="store_true",
        help="Also log to Weights & Biases (needs the wandb package: pip install 'rl-plugin[wandb]').",
    )
    add_flag(g, "--wandb-project", type=str, default="rl_plugin", help="Weights & Biases project for --use-wandb.")
    add_flag(
        g,
        "--no-progress-bar",
        action="store_true",
        help="Disable the tqdm progress bar (e.g. in batch jobs whose logs are files).",
    )
    return parser


def validate(args) -> None:
    if args.use_wandb and importlib.util.find_spec("wandb") is None:
        fail(
            "--use-wandb",
            "the wandb package is not installed",
            "pip install 'rl-plugin[wandb]' (or wandb), or drop --use-wandb",
        )
