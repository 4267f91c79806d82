"""Where per-step metrics go: JSONL (``--metrics-file``), TensorBoard, Weights & Biases.

The metrics file holds only quantities that are a function of seed and flags (rewards, losses,
grad norms), one JSON line per optimizer step plus one per evaluation, so two runs with the same
seed and flags write byte-identical files. Wall-clock timings go to ``timings.jsonl`` beside it
(and to TensorBoard / W&B). Both files are opened in append mode and flushed after every line: a
resumed or crashed run never loses a line already written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Optional


def _clean(d: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # JSON has no NaN/inf; keep them visible as strings
        out[k] = v
    return out


class MetricsLogger:
    def __init__(self, args, metrics_file: str):
        self.metrics_path = Path(metrics_file)
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.timings_path = self.metrics_path.with_name(self.metrics_path.stem + ".timings.jsonl")
        self._metrics = self.metrics_path.open("a")
        self._timings = self.timings_path.open("a")
        self._tb = None
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(args.tensorboard_dir)
        self._wandb = None
        if args.use_wandb:
            import wandb

            self._wandb = wandb.init(project=args.wandb_project, config=vars(args), resume="allow")

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
