"""Run the trainer (``python -m rl_plugin.train``, what ``rl-plugin-train`` runs) in a subprocess
and read what it wrote: the one runner of the benchmarks that time or score whole runs.

    run = train_run(["--train-backend", "fsdp", ...], out, what="fsdp seed 1")
    run.rows       # metrics.jsonl: one dict per line (rewards, losses; keyed by rollout_id)
    run.timings    # metrics.timings.jsonl: one dict per line (time/... phases)
    run.wall_s     # the subprocess's wall time, start-up included
    rewards(run.rows)   # {rollout_id: reward_mean}

``out`` (the run's ``--output-dir``) is emptied first. The subprocess runs in ``cwd`` (the
repository root unless given: another checkout runs its own code) with ``env`` (default: this
process's). ``log=True`` writes its stdout and stderr to ``<out>.log``, else they are discarded.
A non-zero exit raises ``SystemExit`` naming ``what`` and the log.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@dataclass
class TrainRun:
    out: Path
    wall_s: float

    @property
    def rows(self) -> List[dict]:
        return read_jsonl(self.out / "metrics.jsonl")

    @property
    def timings(self) -> List[dict]:
        return read_jsonl(self.out / "metrics.timings.jsonl")


def train_run(
    flags: List[str],
    out: Path,
    *,
    what: str,
    cwd: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
    log: bool = True,
) -> TrainRun:
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rl_plugin.train", *flags, "--output-dir", str(out), "--no-progress-bar"]
    log_path = out.with_suffix(".log")
    t0 = time.perf_counter()
    with open(log_path if log else "/dev/null", "w") as sink:
        rc = subprocess.run(cmd, cwd=cwd or ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        where = f"see {log_path}" if log else f"rerun: {' '.join(cmd)}"
        raise SystemExit(f"{what}: rl-plugin-train exited {rc}; {where}")
    return TrainRun(out, wall)


def rewards(rows: List[dict]) -> Dict[int, float]:
    """``{rollout_id: reward_mean}`` of the rows that carry a reward (the last row of an id wins)."""
    return {r["rollout_id"]: r["reward_mean"] for r in rows if "reward_mean" in r}
