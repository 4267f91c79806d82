"""Time saved per rollout by taking old log-probs from the training forward (issue 12, "no
redundant forward"), per backend, on the tiny model (CPU, gloo, DP = 1).

    python -m benchmarks.old_log_probs [--rollouts 6] [--backends fsdp,megatron]

One process per backend builds the backend once and runs ``TrainActor.train_rollout`` on the same
one-step rollout (16 samples, --micro-batch-size 4, with engine log-probs so the mismatch metrics
are measured), alternating the separate old-log-prob pass and the fused path, after one warm-up
rollout of each. Reported: the median wall time of a rollout for each, the time saved and the
ratio fused / separate (same process, interleaved, so machine load hits both alike).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch


def worker(rank, world, backend_name, hf_dir, rollouts):
    from benchmarks.fsdp_step import make_batch
    from rl_plugin.arguments import parse_args
    from rl_plugin.configs import TrainConfig
    from rl_plugin.ray.train_actor import TrainActor, backend_class
    from rl_plugin.step_plan import RankPlan

    config = TrainConfig.from_args(
        parse_args(
            [
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
        )
    )
    backend = backend_class(backend_name).from_config(config)
    actor = TrainActor(rank, world)
    actor.config, actor.backend = config, backend
    batch, groups = make_batch()
    g = torch.Generator().manual_seed(3)
    batch = replace(
        batch,
        rollout_log_probs=backend.compute_log_probs(batch)
        + 0.05 * torch.randn(int(batch.response_lengths.sum()), generator=g),
    )
    times = {False: [], True: []}
    for i in range(rollouts + 1):
        for fused in (False, True):
            actor.fuse_old_log_probs = fused
            t0 = time.perf_counter()
            actor.train_rollout(RankPlan(replace(batch), [(0, batch.num_samples)], [groups]))
            if i:  # the first rollout of each warms up
                times[fused].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--backends", default="fsdp,megatron")
    opts = parser.parse_args(argv)
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint
    from tests.support.harness import run_world

    hf_dir = str(make_tiny_hf_checkpoint(Path(tempfile.mkdtemp()) / "tiny-qwen2", "qwen2"))
    print(f"\n## one-step rollout, tiny Qwen2, 16 samples, median of {opts.rollouts} (CPU, DP=1)\n")
    print("| backend | separate old pass (ms) | fused (ms) | saved (ms) | fused / separate |")
    print("|---|---|---|---|---|")
    for name in [n for n in opts.backends.split(",") if n]:
        r = run_world(worker, 1, name, hf_dir, opts.rollouts)[0]
        sep, fus = r[False], r[True]
        print(f"| {name} | {sep * 1e3:.1f} | {fus * 1e3:.1f} | {(sep - fus) * 1e3:.1f} | {fus / sep:.2f}x |")


if __name__ == "__main__":
    main()
