"""Wall time of one training step of the tiny model, per backend and data-parallel layout (CPU, gloo).

Each layout runs in fresh processes (``torch.set_num_threads(1)`` per rank): build the backend
from the seeded tiny Qwen2 checkpoint, one warm-up step, then ``--steps`` timed steps on a
16-sample batch (--micro-batch-size 4, PPO, sample_mean, fp32). The step time is the median over
the timed steps of rank 0's wall time between two barriers. The Megatron column is measured
when ``rl_plugin.backends.megatron`` is importable.

    python -m benchmarks.fsdp_step [--steps 5] [--backends fsdp,megatron]

On a 2-core machine DP=2 runs two processes on two cores, so the DP2/DP1 ratio shows the
communication and per-process overhead more than a speed-up.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch


def make_batch(num_samples: int = 16, vocab: int = 128, seed: int = 0):
    from rl_plugin.loss import StepBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(8, 17, (num_samples,), generator=g)
    resp = torch.randint(8, 25, (num_samples,), generator=g)
    total = prompt + resp
    r = int(resp.sum())
    return StepBatch(
        tokens=torch.randint(1, vocab, (int(total.sum()),), generator=g),
        total_lengths=total,
        response_lengths=resp,
        loss_mask=torch.ones(r),
        advantages=torch.randn(num_samples, generator=g).repeat_interleave(resp),
        group_ids=torch.arange(num_samples) // 4,
    ), num_samples // 4


def worker(rank, world, backend_name, hf_dir, steps):
    import torch.distributed as dist

    from rl_plugin.arguments import parse_args
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    flags = [
        "--train-backend",
        backend_name,
        "--hf-checkpoint",
        hf_dir,
        "--micro-batch-size",
        "4",
        "--lr",
        "1e-4",
        "--actor-num-gpus-per-node",
        str(world),
    ]
    args = parse_args(flags)
    if backend_name == "fsdp":
        from rl_plugin.backends.fsdp.backend import FSDPBackend as Backend
    else:
        from rl_plugin.backends.megatron.backend import MegatronBackend as Backend
    backend = Backend.from_args(args)
    batch, groups = make_batch()
    local = batch.select(split_samples_for_dp(batch.num_samples, world)[rank])
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        report = backend.train_step(local, num_groups=groups)
        dist.barrier()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return dict(median=statistics.median(times), loss=report["loss"], tokens=int(local.total_lengths.sum()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backends", default="fsdp,megatron")
    opts = parser.parse_args(argv)
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint
    from tests.support.harness import run_world

    hf_dir = str(make_tiny_hf_checkpoint(Path(tempfile.mkdtemp()) / "tiny-qwen2", "qwen2"))
    names = [n for n in opts.backends.split(",") if n]
    if "megatron" in names and importlib.util.find_spec("rl_plugin.backends.megatron.backend") is None:
        print("megatron backend not importable: skipped")
        names.remove("megatron")
    rows = []
    for name in names:
        for world in (1, 2):
            r = run_world(worker, world, name, hf_dir, opts.steps)[0]
            rows.append((name, world, r["median"], r["loss"]))
    base = rows[0][2]
    print(
        f"\n## one training step, tiny Qwen2 (16 samples, ~{int(make_batch()[0].total_lengths.sum())} tokens), median of {opts.steps}\n"
    )
    print(f"| backend | DP | step (ms) | vs {rows[0][0]} DP1 | J |")
    print("|---|---|---|---|---|")
    for name, world, t, loss in rows:
        print(f"| {name} | {world} | {t * 1e3:.1f} | {t / base:.2f}x | {loss:.6f} |")


if __name__ == "__main__":
    main()
