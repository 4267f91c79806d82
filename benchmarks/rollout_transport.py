"""The per-rollout time outside the two engines (transport: Ray calls, pickling, the driver's
batch preparation, the manager's assembly and scoring) of the embedded loop, for two checkouts
run alternately in the same session: ``--before REV`` (exported with ``git archive``; or a
directory with a copy of the code) against this script's checkout.

From ``metrics.timings.jsonl`` of each run, per rollout:

- ``generate_call_overhead`` = ``time/rollout_call`` - ``time/rollout_generate`` (the engine)
  - ``time/rollout_reward`` (scoring): the generate call's Ray round trip, the RolloutData's
  assembly and pickling;
- ``train_call_overhead`` = ``time/train`` - ``time/log_probs`` - ``time/train_step``: the
  driver's batch preparation (advantages, step plan), the plan's and reports' transport;
- ``outside_engines`` = ``time/rollout_total`` - engine - scoring - old log-probs - train steps
  - the engines' weight load: everything that is not compute.

Printed: the median over rollouts after ``--skip`` of each, before, after and the ratio, with
the per-round medians (the machine's speed drifts; compare within rounds).

    python benchmarks/rollout_transport.py --before main [--backends megatron fsdp] [--rounds 3]
        [--num-rollout 30] [-- extra rl-plugin-train flags]

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
PHASES = (
    "time/rollout_total",
    "outside_engines",
    "generate_call_overhead",
    "train_call_overhead",
    "time/weight_sync",
    "time/rollout_generate",
    "time/train_step",
)


def derived(r: dict) -> dict:
    engine = r["time/rollout_generate"] + r["time/rollout_reward"]
    compute = engine + r["time/log_probs"] + r["time/train_step"] + r["time/weight_load_engines"]
    return {
        **r,
        "generate_call_overhead": r["time/rollout_call"] - engine,
        "train_call_overhead": r["time/train"] - r["time/log_probs"] - r["time/train_step"],
        "outside_engines": r["time/rollout_total"] - compute,
    }


def run(tree: Path, backend: str, out: Path, num_rollout: int, extra: list) -> list:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "rl_plugin.train", "--train-backend", backend, "--num-rollout", str(num_rollout)]
    cmd += ["--output-dir", str(out), "--no-progress-bar", *extra]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [derived(json.loads(line)) for line in open(out / "metrics.timings.jsonl")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--before", required=True, help="git revision (or a directory holding a copy of the code) to compare against"
    )
    p.add_argument("--backends", nargs="+", default=["megatron"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-rollout", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up rollouts left out of the medians")
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(a.before)
        if not before.is_dir():  # a git revision: exported beside the runs
            before = Path(tmp) / "before"
            before.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.before], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        for i in range(a.rounds):
            for backend in a.backends:
                sides = (("before", before), ("after", ROOT)) if i % 2 == 0 else (("after", ROOT), ("before", before))
                for side, tree in sides:  # alternate which goes first
                    got = run(tree, backend, Path(tmp) / f"{backend}-{side}-{i}", a.num_rollout, extra)
                    rows.setdefault((backend, side), []).append(got[a.skip :])
    for backend in a.backends:
        print(
            f"\n{backend}: median ms over rollouts {a.skip + 1}..{a.num_rollout} of {a.rounds} round(s); "
            f"before = {a.before}, after = working tree"
        )
        print(f"{'phase':24} {'before':>8} {'after':>8} {'ratio':>6}   per-round: before | after")
        for k in PHASES:
            med, per = {}, {}
            for side in ("before", "after"):
                runs = rows[backend, side]
                med[side] = 1000 * median(r[k] for run_rows in runs for r in run_rows)
                per[side] = " ".join(f"{1000 * median(r[k] for r in run_rows):.2f}" for run_rows in runs)
            print(
                f"{k:24} {med['before']:8.2f} {med['after']:8.2f} {med['after'] / med['before']:6.2f}   "
                f"{per['before']} | {per['after']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
