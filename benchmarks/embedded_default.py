"""Benchmark: the embedded default (`rl-plugin-train --train-backend X`, no other flags) per backend.

Runs the real job in a subprocess for each backend and prints the reward table: mean reward over
the first 10 and the last 10 rollouts, their ratio and difference (target: ratio >= 3 and
difference >= +0.3), seconds per rollout (generate + train + weight sync, from the timings file)
and the wall time of the whole job. Not a test: numbers depend on the machine and its load.

    python -m benchmarks.embedded_default [--backends megatron fsdp] [extra rl-plugin-train flags]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import mean

from benchmarks._runner import ROOT, rewards, train_run


def run(backend: str, out: Path, extra) -> dict:
    done = train_run(["--train-backend", backend, *extra], out, what=backend)
    rows, wall = done.rows, done.wall_s
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    per_rollout = [t["time/rollout_total"] for t in done.timings if "time/rollout_total" in t]
    r = list(rewards(rows).values())
    first, last = mean(r[:10]), mean(r[-10:])
    return dict(
        backend=backend,
        rollouts=len(r),
        first10=first,
        last10=last,
        ratio=last / max(first, 1e-9),
        delta=last - first,
        eval_first=evals[0] if evals else float("nan"),
        eval_last=evals[-1] if evals else float("nan"),
        s_per_rollout=mean(per_rollout),
        wall_s=wall,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["megatron", "fsdp"])
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench"))
    known, extra = p.parse_known_args()
    results = [run(b, Path(known.out) / f"embedded_{b}", extra) for b in known.backends]
    head = f"{'backend':9} {'rollouts':>8} {'first10':>8} {'last10':>8} {'ratio':>6} {'delta':>6} {'eval0':>6} {'evalN':>6} {'s/rollout':>9} {'wall s':>7}  learns?"
    print(head)
    for x in results:
        ok = x["ratio"] >= 3 and x["delta"] >= 0.3
        print(
            f"{x['backend']:9} {x['rollouts']:8d} {x['first10']:8.3f} {x['last10']:8.3f} {x['ratio']:6.2f} {x['delta']:+6.3f} "
            f"{x['eval_first']:6.3f} {x['eval_last']:6.3f} {x['s_per_rollout']:9.3f} {x['wall_s']:7.1f}  {'yes' if ok else 'NO'}"
        )
    return 0 if all(x["ratio"] >= 3 and x["delta"] >= 0.3 for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())
