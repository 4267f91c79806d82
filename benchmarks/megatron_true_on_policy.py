"""Benchmark: the Megatron backend's forward (``compute_log_probs``) with true on-policy mode off and on.

One training rank (gloo, TP1), the same seeded batch of packed samples, for the embedded tiny
Qwen2 and a SmolLM2-135M-shaped random Llama (hidden 576, 9 / 3 heads, MLP 1536, vocab 49,152,
tied head, ``--layers`` layers). Per shape it builds the backend with the mode off, times
``--rounds`` forwards, then the same with the mode on (``TrainConfig.true_on_policy``:
``invariant_spec`` + the loss core's ``invariant_head``), and prints the medians, the ratio
on / off and the max |diff| of the two log-probs. ``--off-only`` times the default path alone, and
needs nothing of issue 45: run it with ``PYTHONPATH`` at another checkout to compare the default
path before / after a change. Not a test: the numbers depend on the machine and its load.

    python -m benchmarks.megatron_true_on_policy [--rounds 7] [--layers 2] [--off-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.true_on_policy import checkpoint  # the same model shapes as the op benchmark


def _batch(vocab: int, samples: int = 32):
    from tests.support.megatron_common import synthetic_batch

    return synthetic_batch(
        seed=0, num_prompts=samples // 4, n_per_prompt=4, vocab=vocab, max_prompt=24, max_response=40
    )[0]


def _worker(rank, world, ckpt, vocab, rounds, modes):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.configs.run import RunConfig
    from tests.support.megatron_common import make_args

    torch.set_num_threads(1)
    batch = _batch(vocab)
    out = {}
    for mode in modes:
        train = RunConfig.from_args(make_args("--hf-checkpoint", ckpt, "--rollout-temperature", "0.7")).train
        if mode:
            train = dataclasses.replace(train, true_on_policy=True)
        backend = MegatronBackend.from_config(train)
        logp = backend.compute_log_probs(batch)  # warm-up
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            backend.compute_log_probs(batch)
            times.append(time.perf_counter() - start)
        out[mode] = (statistics.median(times), logp, int(batch.response_lengths.sum()), int(batch.total_lengths.sum()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--off-only", action="store_true")
    args = parser.parse_args()
    from tests.support.harness import run_world

    modes = (False,) if args.off_only else (False, True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, vocab in (("embedded", 16), ("smollm2-shaped", 49152)):
            ckpt = checkpoint(name, Path(tmp), args.layers)
            res = run_world(_worker, 1, ckpt, vocab, args.rounds, modes)[0]
            off, logp_off, n, total = res[False]
            line = f"{name}: {total} tokens packed ({n} scored), mode off {off * 1e3:.1f} ms"
            if True in res:
                on, logp_on, _, _ = res[True]
                diff = float((logp_on - logp_off).abs().max())
                line += f", mode on {on * 1e3:.1f} ms (x{on / off:.2f}); max |logp on - off| {diff:.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
