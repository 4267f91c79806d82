"""Loss-core benchmarks (CPU): prints three tables with ratios against baselines run here.

1. Aggregation (sample_mean), forward + backward, best of ``repeat`` runs: the per-sample Python
   loop of slime-style reducers (``sum(x_i.sum() / M_i for i in samples)``); ``aggregate`` (builds
   the counts and per-token weights, then reduces: what a step does once); the per-micro-batch
   reduction with the step's weights (``sum(x * w)``); and a bare ``dot(x, w)``.
2. Log-probs + entropy from materialised bf16 logits: the chunked kernel
   (``log_probs_and_entropy``) against the plain ``log_softmax`` over the whole [T, V] fp32 logits.
3. The LM head + log-probs + entropy, forward + backward, from bf16 hidden rows [T, H] and a bf16
   weight [V, H]: unfused (``hidden @ weight.T`` = bf16 logits [T, V], then
   ``log_probs_and_entropy``: today's path) against ``fused_log_probs_and_entropy``.

Tables 2 and 3 run each case in a fresh process (one thread) and report its wall time and its
peak memory: the kernel's high-water mark of the resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` once the inputs exist, after a warm-up pass at a tiny size) minus the
resident set at that moment, so it counts every byte torch (or anything else) touched during the
pass. "work MiB" subtracts the gradients of hidden and weight, which every path
returns. Unfused cases whose [T, V] buffers would not fit ``--mem-limit-gib`` are printed as
skipped with the size of one fp32 [T, V] buffer.

    python -m benchmarks.loss_core [--quick] [--hidden 256] [--mem-limit-gib 6] [--tables 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def _time(fn, repeat):
    """Best of ``repeat`` timed runs after one warm-up (the machine is shared: the minimum is the
    run least disturbed by other processes)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def aggregation_table(sample_counts, repeat):
    from rl_plugin.loss import aggregate
    from rl_plugin.loss.aggregation import token_weights
    from rl_plugin.loss.counts import counts_of
    from rl_plugin.parallel import ParallelState

    print("\n## sample_mean reduction, forward + backward (ms, best of %d)\n" % repeat)
    print(
        f"{'samples':>8} {'tokens':>8} {'per-sample loop':>16} {'aggregate':>10} {'reduce':>8} {'dot(x,w)':>9} "
        f"{'loop/aggregate':>15} {'loop/reduce':>12} {'aggregate/dot':>14} {'reduce/dot':>11}"
    )
    for n in sample_counts:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, 256, (n,), generator=g)
        x = torch.randn(int(lengths.sum()), generator=g, requires_grad=True)
        mask = (torch.rand(x.shape[0], generator=g) > 0.1).float()
        split = lengths.tolist()
        counts = counts_of(mask, lengths, torch.arange(n), ParallelState.single())
        w = token_weights("sample_mean", counts, mask, lengths, torch.arange(n), dtype=x.dtype)

        def loop():
            total = (
                sum((xi * mi).sum() / mi.sum().clamp_min(1) for xi, mi in zip(x.split(split), mask.split(split))) / n
            )
            total.backward()

        def agg():
            aggregate(x, mask, lengths, "sample_mean").backward()

        def reduce():
            (x * w).sum().backward()

        def dot():
            torch.dot(x, w).backward()

        a = _time(loop, max(1, repeat // 4)) * 1e3
        b, c, d = (_time(f, repeat) * 1e3 for f in (agg, reduce, dot))
        print(
            f"{n:>8} {x.shape[0]:>8} {a:>16.2f} {b:>10.3f} {c:>8.3f} {d:>9.3f} {a / b:>14.1f}x {a / c:>11.1f}x "
            f"{b / d:>13.2f}x {c / d:>10.2f}x"
        )


# Peak memory of one pass: reset the kernel's high-water mark of the resident set after the inputs
# exist (writing 5 to /proc/self/clear_refs, Linux >= 4.0), then VmHWM - VmRSS over the pass.
MEMORY = r"""
import re
def _status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")
def peak():
    return _status("VmHWM")
"""

CHILD = (
    MEMORY
    + r"""
import json, sys, time, torch
from rl_plugin.loss import log_probs_and_entropy
mode, rows, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
targets = torch.randint(0, vocab, (rows,))
base = reset_peak()
t0 = time.perf_counter()
if mode == "full":
    lp_all = torch.log_softmax(logits.float(), -1)
    lp = lp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
else:
    lp, ent = log_probs_and_entropy(logits, targets, chunk_size=256)
(lp.sum() + ent.sum()).backward()
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "extra_mib": peak() - base}))
"""
)


def logprob_table(shapes):
    print("\n## log-probs + entropy, forward + backward, bf16 logits (fresh process each)\n")
    print(
        f"{'rows x vocab':>16} {'full fp32 s':>12} {'chunked s':>10} {'time ratio':>11} {'full MiB':>9} {'chunked MiB':>12} {'memory ratio':>13}"
    )
    for rows, vocab in shapes:
        res = {}
        for mode in ("full", "chunked"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, str(rows), str(vocab)], capture_output=True, text=True, check=True
            )
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        f, c = res["full"], res["chunked"]
        print(
            f"{f'{rows} x {vocab}':>16} {f['seconds']:>12.3f} {c['seconds']:>10.3f} {c['seconds'] / f['seconds']:>10.2f}x "
            f"{f['extra_mib']:>9.0f} {c['extra_mib']:>12.0f} {c['extra_mib'] / max(f['extra_mib'], 1):>12.2f}x"
        )


HEAD_CHILD = (
    MEMORY
    + r"""
import json, sys, time, torch
from rl_plugin.loss import log_probs_and_entropy
from rl_plugin.loss.fused_head import fused_log_probs_and_entropy
torch.set_num_threads(1)
mode, rows, vocab, hid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def run(h, w, t):
    if mode == "unfused":
        lp, ent = log_probs_and_entropy(h @ w.t(), t)
    else:
        lp, ent = fused_log_probs_and_entropy(h, w, t)
    (lp.sum() + ent.sum()).backward()

def inputs(r, v):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(r, hid, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hid, generator=g) / hid ** 0.5).to(torch.bfloat16).requires_grad_(True)
    return h, w, torch.randint(0, v, (r,), generator=g)

run(*inputs(64, 512))  # warm-up: kernels, allocator
h, w, t = inputs(rows, vocab)
base = reset_peak()
t0 = time.perf_counter()
run(h, w, t)
dt = time.perf_counter() - t0
grads = (h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()) / 2 ** 20
print(json.dumps({"seconds": dt, "extra_mib": peak() - base, "grads_mib": grads}))
"""
)


def head_table(shapes, hidden, mem_limit_gib):
    print(
        f"\n## LM head + log-probs + entropy, forward + backward, bf16 hidden [T, {hidden}] and weight [V, {hidden}] "
        "(fresh process each, one thread)\n"
    )
    print(
        f"{'T x V':>14} {'fp32 [T,V] MiB':>15} {'unfused s':>10} {'fused s':>8} {'time fused/unfused':>19} "
        f"{'unfused work MiB':>17} {'fused work MiB':>15} {'fused work / fp32 [T,V]':>24}"
    )
    for rows, vocab in shapes:
        tv_mib = rows * vocab * 4 / 2**20
        # unfused holds the bf16 logits and their bf16 gradient ([T, V] x 2 bytes each)
        fits = rows * vocab * 4 <= mem_limit_gib * 2**30
        res = {}
        for mode in ("unfused", "fused") if fits else ("fused",):
            out = subprocess.run(
                [sys.executable, "-c", HEAD_CHILD, mode, str(rows), str(vocab), str(hidden)],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            r["work_mib"] = max(r["extra_mib"] - r["grads_mib"], 0.0)
            res[mode] = r
        f = res["fused"]
        if fits:
            u = res["unfused"]
            unfused_cols = f"{u['seconds']:>10.2f} {f['seconds']:>8.2f} {f['seconds'] / u['seconds']:>18.2f}x {u['work_mib']:>17.0f}"
        else:
            unfused_cols = f"{'skipped':>10} {f['seconds']:>8.2f} {'-':>19} {'skipped':>17}"
        print(
            f"{f'{rows // 1024}k x {vocab // 1000}k':>14} {tv_mib:>15.0f} {unfused_cols} {f['work_mib']:>15.1f} "
            f"{f['work_mib'] / tv_mib:>23.3f}x"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=256, help="H of the head table")
    ap.add_argument(
        "--mem-limit-gib",
        type=float,
        default=6.0,
        help="skip an unfused head case whose fp32 [T, V] buffer is larger than this",
    )
    ap.add_argument("--tables", default="1,2,3")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    tables = set(ns.tables.split(","))
    if "1" in tables:
        aggregation_table([64, 512] if ns.quick else [64, 512, 4096], repeat=8 if ns.quick else 20)
    if "2" in tables:
        logprob_table([(1024, 8192)] if ns.quick else [(1024, 8192), (2048, 32000)])
    if "3" in tables:
        shapes = [(2048, 32000)] if ns.quick else [(t, v) for t in (2048, 8192, 32768) for v in (32000, 152064)]
        head_table(shapes, ns.hidden, ns.mem_limit_gib)


if __name__ == "__main__":
    main()
