"""LoggingConfig: what the loop writes and where (metrics JSONL, TensorBoard, Weights & Biases,
the console summary and progress bar)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, Bounds, Declared, flag

GROUP = "logging"


@dataclass(frozen=True)
class LoggingConfig(Declared):
    output_dir: Optional[str] = flag(
        "--output-dir",
        type=str,
        default=None,
        group=GROUP,
        help="Directory for the run's metrics, reward curve and (with the embedded default) checkpoints. Default: outputs/embedded_<backend> for the embedded task, else outputs/run.",
    )
    metrics_file: Optional[str] = flag(
        "--metrics-file",
        type=str,
        default=None,
        group=GROUP,
        help="JSONL file with one line per train step (and per evaluation). Appended to, never truncated, so a resumed run keeps the lines already written. Default: <output-dir>/metrics.jsonl.",
    )
    tensorboard_dir: Optional[str] = flag(
        "--tensorboard-dir",
        type=str,
        default=None,
        group=GROUP,
        help="Write the per-step metrics as TensorBoard scalars here.",
    )
    use_wandb: bool = flag(
        "--use-wandb",
        action="store_true",
        group=GROUP,
        help="Also log to Weights & Biases (needs the wandb package: pip install 'rl-plugin[wandb]').",
    )
    wandb_project: str = flag(
        "--wandb-project",
        type=str,
        default="rl_plugin",
        group=GROUP,
        help="Weights & Biases project for --use-wandb.",
    )
    no_progress_bar: bool = flag(
        "--no-progress-bar",
        action="store_true",
        group=GROUP,
        help="Disable the tqdm progress bar (e.g. in batch jobs whose logs are files).",
    )
    log_interval: int = flag(
        "--log-interval",
        type=int,
        default=1,
        help="Print a one-line summary of the training metrics (reward, loss, grad norm, step timings) every N optimizer steps, with or without the progress bar.",
        bounds=Bounds(1, "--log-interval 1"),
        **MEGATRON,
    )

    def check(self, run) -> None:
        if self.use_wandb and importlib.util.find_spec("wandb") is None:
            fail(
                "--use-wandb",
                "the wandb package is not installed",
                "pip install 'rl-plugin[wandb]' (or wandb), or drop --use-wandb",
            )
