"""Benchmark: the synchronous loop against overlapped training (--max-weight-staleness 1) on the
embedded default (`rl-plugin-train --train-backend X`, HF engine), same seeds, same session.

Each (backend, seed) runs the synchronous loop first, then every other mode, as subprocesses one
after another. Printed per run: seconds per rollout (mean of ``time/rollout_total``: generate +
train + weight sync, overlapped or not) and the job's wall time, each with its ratio to the
synchronous run of the same backend and seed (< 1: faster); the trainer's wait for generation and
the generation time hidden behind training (``time/trainer_wait_generate``, ``time/overlap_saved``);
and the learning curve at equal samples (every rollout has the same sample count, so rollout
index = samples seen): mean reward over each third of the run, its difference to the synchronous
run's last third, the last evaluation, and the mean |old - rollout| log-prob gap the stale sampler
leaves (``rollout_log_prob_diff``). Not a test: timings depend on the machine and its load. On a
machine where the engine and the trainer share the same few CPU cores, overlap cannot save much:
the two halves compete for the cores.

    python -m benchmarks.async_loop [--backends megatron fsdp] [--seeds 1234 1] [--modes sync async async_tis]
                                    [extra rl-plugin-train flags]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import mean

from benchmarks._runner import ROOT, train_run

MODES = {
    "sync": [],
    "async": ["--max-weight-staleness", "1"],
    "async_tis": ["--max-weight-staleness", "1", "--use-tis"],
}


def run(backend: str, mode: str, seed: int, out: Path, extra) -> dict:
    flags = ["--train-backend", backend, "--seed", str(seed), *MODES[mode], *extra]
    done = train_run(flags, out, what=f"{backend} {mode} seed {seed}")
    rows, timings, wall = done.rows, done.timings, done.wall_s
    per_rollout = [t for t in timings if "time/rollout_total" in t]
    reward, gap = {}, {}
    for r in rows:
        if "reward_mean" in r:
            reward[r["rollout_id"]] = r["reward_mean"]
            gap.setdefault(r["rollout_id"], r.get("rollout_log_prob_diff", float("nan")))
    curve = [reward[k] for k in sorted(reward)]
    third = max(1, len(curve) // 3)
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    return dict(
        backend=backend,
        mode=mode,
        seed=seed,
        rollouts=len(curve),
        wall=wall,
        s_rollout=mean(t["time/rollout_total"] for t in per_rollout),
        wait=mean(t.get("time/trainer_wait_generate", t.get("time/rollout_call", 0.0)) for t in per_rollout),
        saved=mean(t.get("time/overlap_saved", 0.0) for t in per_rollout),
        thirds=[mean(curve[i * third : (i + 1) * third]) for i in range(3)],
        eval_last=evals[-1] if evals else float("nan"),
        gap=mean(gap.values()),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["megatron"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1234])
    p.add_argument("--modes", nargs="+", default=["sync", "async", "async_tis"], choices=list(MODES))
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_async"))
    known, extra = p.parse_known_args()
    modes = ["sync"] + [m for m in known.modes if m != "sync"]  # the baseline first
    results = []
    for backend in known.backends:
        for seed in known.seeds:
            base = None
            for mode in modes:
                x = run(backend, mode, seed, Path(known.out) / f"{backend}_{mode}_{seed}", extra)
                base = base or x
                x["r_rollout"], x["r_wall"] = x["s_rollout"] / base["s_rollout"], x["wall"] / base["wall"]
                x["d_last"] = x["thirds"][2] - base["thirds"][2]
                results.append(x)
                print(f"done: {backend} {mode} seed {seed} ({x['wall']:.0f} s)", file=sys.stderr, flush=True)
    print(
        f"{'backend':9} {'mode':9} {'seed':>5} {'rollouts':>8} {'s/rollout':>9} {'ratio':>6} {'wall s':>7} {'ratio':>6} "
        f"{'wait s':>7} {'saved s':>7} {'reward 1/3':>10} {'2/3':>6} {'3/3':>6} {'d 3/3':>6} {'evalN':>6} {'|old-roll|':>10}"
    )
    for x in results:
        t = x["thirds"]
        print(
            f"{x['backend']:9} {x['mode']:9} {x['seed']:5d} {x['rollouts']:8d} {x['s_rollout']:9.3f} {x['r_rollout']:6.2f} "
            f"{x['wall']:7.1f} {x['r_wall']:6.2f} {x['wait']:7.3f} {x['saved']:7.3f} {t[0]:10.3f} {t[1]:6.3f} {t[2]:6.3f} "
            f"{x['d_last']:+6.3f} {x['eval_last']:6.3f} {x['gap']:10.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
