"""Benchmark: the synchronous loop, one-step-off (--max-weight-staleness 1) and fully async training
(--fully-async, K = 1, 2, 4, with and without partial rollouts) on the embedded task, same seed,
same session, `hf` and vLLM engines.

Each (engine, seed) runs the synchronous loop first, then every other mode, as subprocesses one
after another. ``--long-tail`` makes the task long-tailed: responses up to 59 tokens
(``--rollout-max-response-len 59``, what the tiny model's 64 positions leave after a prompt); the
untrained model's responses spread from a few tokens to the cut (mean ~30, the batch's longest at
the cut), 8 groups x 8 samples per rollout. Printed per run:

- samples/s: trained samples / the loop's time (sum of ``time/rollout_total``), and its ratio to
  the synchronous run of the same engine (> 1: faster);
- trainer wait: mean seconds the trainer waited for data per rollout (``time/trainer_wait_generate``;
  the synchronous loop's whole generate call);
- time to threshold: loop seconds until a rollout's mean reward first reached ``--threshold``;
- the staleness histogram: rollouts per rounded ``async/staleness_mean`` (one-step-off: its
  ``weight_staleness``), the mean ``async/partial_frac`` and the groups dropped as stale.

Then the cluster estimate, from the synchronous run's own phase times per rollout (G: engine
generate + reward, T: train, S: weight sync) and its mean / max response length (L, Lmax), for a
cluster where generation and training have their own devices (an estimate, not a measurement):

    sync            G + T + S
    one-step-off    max(G, T) + S
    fully async     max(G * L / Lmax, T) + S / I       (I = --update-weights-interval)

The fully-async line assumes partial rollouts keep the engine's batch full (a finished trajectory's
slot is refilled, an update does not drain it), so generation costs the tokens generated, not the
longest trajectory of the batch. Not a test: timings depend on the machine and its load; on a
machine where the engine and the trainer share the same few CPU cores, overlap cannot save much.

    python -m benchmarks.async_loop [--long-tail] [--engines hf vllm] [--backends fsdp] [--seeds 1234]
                                    [--modes sync off1 fa_k1 fa_k2 fa_k4 fa_k2_nopartial] [--threshold 0.1]
                                    [extra rl-plugin-train flags]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from statistics import mean

from benchmarks._runner import ROOT, train_run

FA = ["--fully-async", "--use-tis"]
MODES = {
    "sync": [],
    "async": ["--max-weight-staleness", "1"],
    "async_tis": ["--max-weight-staleness", "1", "--use-tis"],
    "off1": ["--max-weight-staleness", "1", "--use-tis"],
    "fa_k1": [*FA, "--max-weight-staleness", "1"],
    "fa_k2": [*FA, "--max-weight-staleness", "2"],
    "fa_k4": [*FA, "--max-weight-staleness", "4"],
    "fa_k2_nopartial": [*FA, "--max-weight-staleness", "2"],
}
NO_PARTIAL = {"fa_k2_nopartial"}  # rl_plugin.rollout.fully_async.producer.NO_PARTIAL_ENV
LONG_TAIL = ["--rollout-max-response-len", "59", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8"]
LONG_TAIL += ["--micro-batch-size", "64", "--eval-interval", "1000"]


def run(backend: str, engine: str, mode: str, seed: int, out: Path, extra, threshold: float) -> dict:
    flags = ["--train-backend", backend, "--rollout-engine", engine, "--seed", str(seed), *MODES[mode], *extra]
    env = dict(os.environ, RL_PLUGIN_ASYNC_NO_PARTIAL="1" if mode in NO_PARTIAL else "0")
    done = train_run(flags, out, what=f"{backend} {engine} {mode} seed {seed}", env=env)
    rows = [r for r in done.rows if "loss" in r]
    first = {}
    for r in rows:
        first.setdefault(r["rollout_id"], r)
    rollouts = [first[k] for k in sorted(first)]
    per_rollout = [t for t in done.timings if "time/rollout_total" in t]
    totals = [t["time/rollout_total"] for t in per_rollout]
    loop_s = sum(totals)
    samples = sum(r["samples"] for r in rows)
    clock, reached = 0.0, float("nan")
    for r, s in zip(rollouts, totals):
        clock += s
        if r["reward_mean"] >= threshold:
            reached = clock
            break
    hist = collections.Counter(round(r.get("async/staleness_mean", r.get("weight_staleness", 0.0))) for r in rollouts)
    gen = [t.get("time/rollout_generate", 0.0) + t.get("time/rollout_reward", 0.0) for t in per_rollout]
    return dict(
        engine=engine,
        mode=mode,
        rollouts=len(rollouts),
        sps=samples / loop_s,
        wait=mean(t.get("time/trainer_wait_generate", t.get("time/rollout_call", 0.0)) for t in per_rollout),
        reached=reached,
        hist=" ".join(f"{k}:{hist[k]}" for k in sorted(hist)),
        partial=mean(r.get("async/partial_frac", 0.0) for r in rollouts),
        dropped=sum(r.get("async/dropped_stale", 0.0) for r in rollouts),
        len_mean=mean(r["response_len_mean"] for r in rollouts),
        reward_last=mean(r["reward_mean"] for r in rollouts[-5:]),
        G=mean(gen),
        T=mean(t.get("time/train", 0.0) for t in per_rollout),
        S=mean(t.get("time/weight_sync", 0.0) for t in per_rollout),
    )


def cluster_estimate(base: dict, max_len: int, interval: int = 1) -> str:
    g, t, s, ratio = base["G"], base["T"], base["S"], base["len_mean"] / max_len
    sync, off, fa = g + t + s, max(g, t) + s, max(g * ratio, t) + s / interval
    return (
        f"cluster estimate ({base['engine']}): G {g:.3f} s, T {t:.3f} s, S {s:.3f} s, L/Lmax {ratio:.2f} -> "
        f"s/rollout sync {sync:.3f}, one-step-off {off:.3f} ({sync / off:.2f}x), fully async {fa:.3f} ({sync / fa:.2f}x)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["fsdp"])
    p.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1234])
    p.add_argument("--modes", nargs="+", default=["sync", "off1", "fa_k1", "fa_k2", "fa_k4", "fa_k2_nopartial"])
    p.add_argument("--long-tail", action="store_true")
    p.add_argument("--threshold", type=float, default=0.1)
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_async"))
    known, extra = p.parse_known_args()
    bad = sorted(set(known.modes) - set(MODES))
    if bad:
        p.error(f"unknown modes {bad}; choose from {sorted(MODES)}")
    extra = (LONG_TAIL if known.long_tail else []) + extra
    max_len = 59 if known.long_tail else 4
    modes = ["sync"] + [m for m in known.modes if m != "sync"]  # the baseline first
    results, estimates = [], []
    for backend in known.backends:
        for engine in known.engines:
            for seed in known.seeds:
                base = None
                for mode in modes:
                    out = Path(known.out) / f"{backend}_{engine}_{mode}_{seed}"
                    x = run(backend, engine, mode, seed, out, extra, known.threshold)
                    base = base or x
                    x["ratio"] = x["sps"] / base["sps"]
                    results.append(x)
                    print(f"done: {backend} {engine} {mode} seed {seed}", file=sys.stderr, flush=True)
                estimates.append(cluster_estimate(base, max_len))
    print(
        f"| engine | mode | rollouts | samples/s | vs sync | trainer wait s | s to reward >= {known.threshold} | "
        "staleness hist | partial frac | dropped | resp len | reward last 5 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in results:
        print(
            f"| {x['engine']} | {x['mode']} | {x['rollouts']} | {x['sps']:.1f} | {x['ratio']:.2f}x | {x['wait']:.3f} | "
            f"{x['reached']:.1f} | {x['hist']} | {x['partial']:.3f} | {x['dropped']:.0f} | {x['len_mean']:.1f} | "
            f"{x['reward_last']:.3f} |"
        )
    for line in estimates:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
