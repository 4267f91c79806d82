"""Wall time of one Megatron-backend train step on the tiny model, per TP x DP layout (CPU, gloo).

    python -m benchmarks.megatron_step [--steps 5] [--prompts 8] [--n 4] [--layouts 1x1,2x1,1x2,2x2]

Each layout runs in its own spawned world (one process per rank, 1 thread each). The same global
batch is split over DP; after one warm-up step, ``--steps`` steps are timed (barrier before and
after each) and the median is reported, with the ratio to TP1 x DP1. On a 2-core machine a
4-process layout oversubscribes the CPU: read the ratios as overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from tests.support.harness import run_world


def _worker(rank, world, tp, hf_dir, steps, prompts, n):
    import torch
    import torch.distributed as dist

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch

    backend = MegatronBackend.from_args(
        make_args(
            "--hf-checkpoint",
            hf_dir,
            "--tensor-model-parallel-size",
            str(tp),
            "--micro-batch-size",
            "4",
            "--lr",
            "1e-4",
            world_size=world,
        )
    )
    batch, groups = synthetic_batch(seed=0, num_prompts=prompts, n_per_prompt=n, max_prompt=32, max_response=64)
    local = dp_shard(batch, backend.parallel_state.dp_size, backend.parallel_state.dp_rank)
    backend.train_step(local, num_groups=groups)  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        backend.train_step(local, num_groups=groups)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "tokens": int(batch.total_lengths.sum()),
        "threads": torch.get_num_threads(),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="TPxDP, comma separated")
    a = p.parse_args(argv)
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    hf_dir = str(make_tiny_hf_checkpoint(os.path.join(tempfile.gettempdir(), "rl_plugin_bench_tiny_qwen2"), "qwen2"))
    rows = []
    for lay in a.layouts.split(","):
        tp, dp = (int(x) for x in lay.split("x"))
        res = run_world(_worker, tp * dp, tp, hf_dir, a.steps, a.prompts, a.n)[0]
        rows.append((tp, dp, res["median_s"], res["tokens"]))
    base = rows[0][2]
    print(
        f"tiny Qwen2 (hidden 32, 2 layers, vocab 128), {rows[0][3]} tokens/step, {a.prompts}x{a.n} samples, "
        f"median of {a.steps} steps, CPU gloo"
    )
    print(f"{'TP':>3} {'DP':>3} {'step (ms)':>10} {'vs TP1xDP1':>11}")
    for tp, dp, t, _ in rows:
        print(f"{tp:>3} {dp:>3} {t * 1e3:>10.1f} {t / base:>10.2f}x")


if __name__ == "__main__":
    main()
