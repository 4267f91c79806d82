"""Where per-step metrics go: JSONL (``--metrics-file``), TensorBoard, Weights & Biases.

The metrics file holds only quantities that are a function of seed and flags (rewards, losses,
grad norms), one JSON line per optimizer step plus one per evaluation, so two runs with the same
seed and flags write byte-identical files. Wall-clock timings go to ``timings.jsonl`` beside it
(and to TensorBoard / W&B). Both files are opened in append mode and flushed after every line: a
resumed or crashed run never loses a line already written.

On resume, lines of steps after the checkpoint's step were written by the interrupted run and
will be written again by the resumed one: ``supersede_after`` moves them (never deletes them) to
``<metrics>.superseded.jsonl``, so the metrics file reads as one run. ``summary_line`` is the
compact line printed every ``--log-interval`` steps.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional


def _clean(d: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # JSON has no NaN/inf; keep them visible as strings
        out[k] = v
    return out


class MetricsLogger:
    """``logging``: the run's ``LoggingConfig`` (TensorBoard, W&B); ``settings``: the run's settings
    W&B records as its config (``configs.run.flat_settings``)."""

    def __init__(self, logging, metrics_file: str, settings: Optional[Dict[str, Any]] = None):
        self.metrics_path = Path(metrics_file)
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.timings_path = timings_path(self.metrics_path)
        self._metrics = self.metrics_path.open("a")
        self._timings = self.timings_path.open("a")
        self._tb = None
        if logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(logging.tensorboard_dir)
        self._wandb = None
        if logging.use_wandb:
            import wandb

            self._wandb = wandb.init(project=logging.wandb_project, config=dict(settings or {}), resume="allow")

    def log(self, step: int, metrics: Dict[str, Any], timings: Optional[Dict[str, float]] = None) -> None:
        self._metrics.write(json.dumps(_clean({"step": step, **metrics}), sort_keys=True) + "\n")
        self._metrics.flush()
        if timings:
            self._timings.write(json.dumps({"step": step, **timings}, sort_keys=True) + "\n")
            self._timings.flush()
        scalars = {**metrics, **(timings or {})}
        if self._tb is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in scalars.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self._metrics.close()
        self._timings.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path) -> list:
    """Every JSON line of a metrics file (for the reward plot and the benchmark)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timings_path(metrics_file) -> Path:
    p = Path(metrics_file)
    return p.with_name(p.stem + ".timings.jsonl")


def superseded_path(path) -> Path:
    p = Path(path)
    return p.with_name(p.stem + ".superseded.jsonl")


def supersede_after(metrics_file, step: int) -> List[int]:
    """Move every line with ``"step" > step`` from the metrics file and its timings file to
    ``*.superseded.jsonl`` (appended, each line tagged ``"superseded_by_resume_from": step``);
    the rest is rewritten atomically. Returns the superseded steps of the metrics file."""
    moved: List[int] = []
    for path in (Path(metrics_file), timings_path(metrics_file)):
        if not path.is_file():
            continue
        keep, drop = [], []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            (drop if json.loads(line).get("step", 0) > step else keep).append(line)
        if not drop:
            continue
        with superseded_path(path).open("a") as f:
            for line in drop:
                f.write(json.dumps({**json.loads(line), "superseded_by_resume_from": step}, sort_keys=True) + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
        if path == Path(metrics_file):
            moved = sorted({json.loads(line)["step"] for line in drop})
    return moved


SUMMARY_KEYS = (
    ("reward_mean", "reward", "{:.3f}"),
    ("loss", "loss", "{:.4g}"),
    ("grad_norm", "grad_norm", "{:.3g}"),
    ("response_len_mean", "resp_len", "{:.1f}"),
    ("lr", "lr", "{:.3g}"),
    ("critic/value_loss", "value_loss", "{:.4g}"),  # PPO's critic (absent otherwise: the line as it was)
    ("critic/explained_variance", "expl_var", "{:.3f}"),
)
SUMMARY_TIMES = (
    ("time/rollout_generate", "gen"),
    ("time/rollout_reward", "reward"),
    ("time/train", "train"),
    ("time/weight_sync", "sync"),
)


def summary_line(step: int, row: Dict[str, Any], timings: Dict[str, float]) -> str:
    """``step 12 | rollout 5 | reward 0.412 | loss -0.0123 | grad_norm 0.53 | ... | gen 0.81s reward 0.02s train 1.20s``"""
    parts = [f"step {step}", f"rollout {row.get('rollout_id')}"]
    for key, name, fmt in SUMMARY_KEYS:
        v = row.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{name} {fmt.format(v)}")
    times = " ".join(f"{name} {timings[key]:.2f}s" for key, name in SUMMARY_TIMES if key in timings)
    return " | ".join(parts + ([times] if times else []))
