"""Per-phase time of the embedded loop (``rl-plugin-train``, HF engine) for two checkouts of the
code, run alternately in the same session: ``--before REV`` (a git revision, exported with
``git archive`` to a temporary directory, or a directory holding a copy of the code) against the
working tree; the side that runs first alternates from round to round.

Each round runs both checkouts once per backend (``--num-rollout`` rollouts, the embedded
default's flags) and reads ``metrics.timings.jsonl``. Printed per backend: the median over all
rollouts after ``--skip`` (warm-up) of each phase, before, after and the ratio (< 1: faster).
``train_call_overhead`` = ``time/train`` minus the actor's own old-log-prob pass, train steps and
weight export + publish (``time/weight_publish``, inside the train call since the sync rides on
it): the driver's batch preparation, Ray's transport of the plans and of the reports. A phase a
checkout does not log (``time/weight_publish`` before the sync rode on the train call) reads 0.
``loop_overhead`` = ``time/rollout_total`` minus the compute of both engines (``time/rollout_generate``,
``time/log_probs``, ``time/train_step``): Ray, the driver, rewards and the weight sync; it cancels
most of the machine's speed drift, which moves the compute phases of a round together.
``generate_call_overhead`` = ``time/rollout_call`` minus the engine's generate, the scoring and
the weight load inside the call: the call's Ray round trip, the rollout's assembly and pickling.

    python -m benchmarks.loop_phases --before main [--backends fsdp megatron] [--rounds 2]
        [--num-rollout 30] [-- extra rl-plugin-train flags]

Not a test: numbers depend on the machine and its load; compare the per-round medians for the noise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from benchmarks._runner import ROOT, train_run

PHASES = (
    "time/rollout_total",
    "time/rollout_call",
    "time/train",
    "time/log_probs",
    "time/train_step",
    "generate_call_overhead",
    "train_call_overhead",
    "loop_overhead",
    "time/weight_sync",
    "time/weight_publish",
    "time/weight_load_engines",
)


def run(tree: Path, backend: str, out: Path, num_rollout: int, extra: list) -> list:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    flags = ["--train-backend", backend, "--num-rollout", str(num_rollout), *extra]
    rows = train_run(flags, out, what=f"{backend} in {tree}", cwd=tree, env=env, log=False).timings
    for r in rows:
        r["train_call_overhead"] = (
            r["time/train"] - r["time/log_probs"] - r["time/train_step"] - r.get("time/weight_publish", 0.0)
        )
        if "time/rollout_call" in r:
            # a checkout that logs time/weight_publish loads the weights inside the generate call
            load_in_call = r.get("time/weight_load_engines", 0.0) if "time/weight_publish" in r else 0.0
            engine = r["time/rollout_generate"] + r.get("time/rollout_reward", 0.0) + load_in_call
            r["generate_call_overhead"] = r["time/rollout_call"] - engine
        if "time/rollout_total" in r:
            r["loop_overhead"] = (
                r["time/rollout_total"] - r["time/rollout_generate"] - r["time/log_probs"] - r["time/train_step"]
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--before", required=True, help="git revision (or a directory holding a copy of the code) to compare against"
    )
    p.add_argument("--backends", nargs="+", default=["fsdp", "megatron"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-rollout", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up rollouts left out of the medians")
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(a.before)
        if not before.is_dir():  # a git revision: exported beside the runs
            before = Path(tmp) / "before"
            before.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.before], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        rows = {(b, side): [] for b in a.backends for side in ("before", "after")}
        for i in range(a.rounds):
            for backend in a.backends:
                sides = (("before", before), ("after", ROOT)) if i % 2 == 0 else (("after", ROOT), ("before", before))
                for side, tree in sides:  # alternate which goes first
                    got = run(tree, backend, Path(tmp) / f"{backend}-{side}-{i}", a.num_rollout, extra)
                    rows[backend, side].append(got[a.skip :])
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
                med[side] = 1000 * median(r.get(k, 0.0) for run_rows in runs for r in run_rows)
                per[side] = " ".join(f"{1000 * median(r.get(k, 0.0) for r in run_rows):.1f}" for run_rows in runs)
            ratio = f"{med['after'] / med['before']:6.2f}" if med["before"] > 0 else "     -"
            print(f"{k:24} {med['before']:8.2f} {med['after']:8.2f} {ratio}   {per['before']} | {per['after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
