"""Loss-core benchmarks (CPU): prints two tables with ratios against a baseline.

1. Aggregation: the per-token-weight reducer (one dot product per micro-batch) against the
   per-sample Python loop of slime-style reducers (``sum(x_i.sum() / M_i for i in samples)``),
   forward + backward, for growing sample counts.
2. Log-probs + entropy: the chunked kernel (``log_probs_and_entropy``) against the plain
   ``log_softmax`` over the whole [T, V] fp32 logits, wall time and peak RSS of a fresh process.

    python benchmarks/loss_core.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def _time(fn, repeat):
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def aggregation_table(sample_counts, repeat):
    from rl_plugin.loss import aggregate

    print("\n## sample_mean reduction, forward + backward (ms)\n")
    print(f"{'samples':>8} {'tokens':>8} {'per-sample loop':>16} {'token weights':>14} {'speed-up':>9}")
    for n in sample_counts:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, 256, (n,), generator=g)
        x = torch.randn(int(lengths.sum()), generator=g, requires_grad=True)
        mask = (torch.rand(x.shape[0], generator=g) > 0.1).float()
        split = lengths.tolist()

        def loop():
            total = sum((xi * mi).sum() / mi.sum().clamp_min(1) for xi, mi in zip(x.split(split), mask.split(split))) / n
            total.backward()

        def weights():
            aggregate(x, mask, lengths, "sample_mean").backward()

        a, b = _time(loop, repeat) * 1e3, _time(weights, repeat) * 1e3
        print(f"{n:>8} {x.shape[0]:>8} {a:>16.2f} {b:>14.2f} {a / b:>8.1f}x")


CHILD = r"""
import json, resource, sys, time, torch
from rl_plugin.loss import log_probs_and_entropy
mode, rows, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
targets = torch.randint(0, vocab, (rows,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if mode == "full":
    lp_all = torch.log_softmax(logits.float(), -1)
    lp = lp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
else:
    lp, ent = log_probs_and_entropy(logits, targets, chunk_size=256)
(lp.sum() + ent.sum()).backward()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": dt, "extra_mib": (peak - base) / 1024}))
"""


def logprob_table(shapes):
    print("\n## log-probs + entropy, forward + backward, bf16 logits (fresh process each)\n")
    print(f"{'rows x vocab':>16} {'full fp32 s':>12} {'chunked s':>10} {'time ratio':>11} {'full MiB':>9} {'chunked MiB':>12} {'memory ratio':>13}")
    for rows, vocab in shapes:
        res = {}
        for mode in ("full", "chunked"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(rows), str(vocab)], capture_output=True, text=True, check=True)
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        f, c = res["full"], res["chunked"]
        print(f"{f'{rows} x {vocab}':>16} {f['seconds']:>12.3f} {c['seconds']:>10.3f} {c['seconds'] / f['seconds']:>10.2f}x "
              f"{f['extra_mib']:>9.0f} {c['extra_mib']:>12.0f} {c['extra_mib'] / max(f['extra_mib'], 1):>12.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    aggregation_table([64, 512] if ns.quick else [64, 512, 4096], repeat=3 if ns.quick else 5)
    logprob_table([(1024, 8192)] if ns.quick else [(1024, 8192), (2048, 32000)])


if __name__ == "__main__":
    main()
