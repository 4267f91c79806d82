"""Throughput of the remote reward model's client (``--rm-type remote_rm``): samples scored per
second by ``SampleScorer`` against a local reward server (``tests.support.reward_server``, a
threaded ``http.server`` on 127.0.0.1) whose every answer takes ``--delay`` seconds (a model's
latency), for each ``--rm-max-concurrency`` in ``--concurrency``.

    python -m benchmarks.remote_rm [--samples 256] [--delay 0.01] [--concurrency 1 4 16 64] [--rounds 3]

With a delay d and concurrency c the ceiling is c / d requests/s (until the server's threads or
the client's event loop saturate); at d = 0 the numbers are the client's and server's own cost
per request. The rounds alternate the settings; the median per setting is printed with the
speed-up over the first setting. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
import time
from statistics import median

from rl_plugin.rollout.rewards.scorer import SampleScorer
from rl_plugin.rollout.sample import Sample
from tests.support.reward_server import RewardServer


def rate(url: str, concurrency: int, samples) -> float:
    args = argparse.Namespace(rm_type="remote_rm", rm_url=url, rm_max_concurrency=concurrency)
    scorer = SampleScorer(args)
    t = time.perf_counter()
    out = scorer.score_samples(samples)
    elapsed = time.perf_counter() - t
    assert len(out) == len(samples) and scorer.remote.retries == 0
    return len(samples) / elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--delay", type=float, default=0.01, help="seconds per answer on the server")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    samples = [
        Sample(index=i, prompt=f"{i:03d}=", response=f"{i:03d}", label=f"{i:03d}", metadata={})
        for i in range(a.samples)
    ]
    rows = {c: [] for c in a.concurrency}
    with RewardServer(lambda payload: {"reward": float(payload["response"] == payload["label"])}, delay=a.delay) as srv:
        rate(srv.url, max(a.concurrency), samples[:8])  # warm-up
        for _ in range(a.rounds):
            for c in a.concurrency:
                rows[c].append(rate(srv.url, c, samples))
        peak = srv.max_in_flight
    base = median(rows[a.concurrency[0]])
    print(
        f"\n{a.samples} samples, server delay {a.delay * 1000:g} ms, {a.rounds} rounds (most in flight on the server: {peak})"
    )
    print(f"{'concurrency':>11} {'samples/s':>10} {'speed-up':>9} {'ceiling c/d':>12}   per round")
    for c, per in rows.items():
        ceiling = f"{c / a.delay:.0f}" if a.delay > 0 else "-"
        print(
            f"{c:11d} {median(per):10.1f} {median(per) / base:9.2f} {ceiling:>12}   "
            + " ".join(f"{x:.1f}" for x in per)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
