"""Benchmark: the cost of true on-policy mode (issue 45, ``rl_plugin.invariant``) against the default path.

For each shape (the embedded tiny Qwen2; a SmolLM2-135M-shaped random Llama: hidden 576, 9 / 3
heads, MLP 1536, vocab 49,152, tied head, but ``--layers`` layers instead of 30) it times, in
alternating order round after round, the same seeded calls with the mode off and on:

- engine: ``HFEngine.generate`` (the lean sampler, KV cache, shared prefill) -> tokens/s;
- trainer forward: the packed micro-batch forward the FSDP backend runs (one row, position ids
  reset per sample, the 4-D block mask only off the mode, which derives the keys from the
  positions) plus the response log-probs (``torch.log_softmax`` vs ``invariant.log_softmax``);
- ops: ``F.linear`` vs ``invariant.linear`` (1, 16 and 512 rows, the MLP's up projection and
  the LM head), sdpa vs ``invariant.attention`` (one 512-token document), ``torch.log_softmax`` vs
  ``invariant.log_softmax`` (64 rows of the vocab);

and prints medians and the time ratio mode / default per token or call (> 1: the mode is slower). It also checks, per
shape, whether the default path's decode logits equal its full-sequence logits bitwise (the
mismatch the mode removes) and that the mode's do. One torch thread (the engine actor's setting;
``--threads 2`` for two). Not a test: the numbers depend on the machine and its load.

    python -m benchmarks.true_on_policy [--rounds 5] [--layers 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rl_plugin import invariant

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def checkpoint(name: str, root: Path, layers: int) -> str:
    """The embedded model's checkpoint, or a random Llama of SmolLM2's widths with ``layers`` layers."""
    if name == "embedded":
        from rl_plugin.loop.embedded_setup import cache_root, ensure_tiny_model

        return str(ensure_tiny_model(cache_root()))
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(root / name, "llama", num_layers=layers, **SMOLLM2_SHAPE))


def _time(fn, rounds: int, results: list) -> None:
    fn()  # warm up
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        results.append(time.perf_counter() - start)


def _median_pair(fns, rounds):
    """Median seconds of (default, mode), alternating one round of each."""
    times = ([], [])
    for fn in fns:
        fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def engine_rows(ckpt: str, rounds: int, vocab: int):
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (12,), generator=g).tolist() for _ in range(4) for _ in range(4)]
    params = SamplingParams(temperature=0.7, max_new_tokens=16)
    engines = [HFEngine(ckpt), HFEngine(ckpt, true_on_policy=True)]
    counts = [0, 0]

    def call(i):
        def run():
            gens = engines[i].generate(prompts, params, seed=1)
            counts[i] = sum(len(gen.response_ids) for gen in gens)

        return run

    off, on = _median_pair([call(0), call(1)], rounds)
    return [("engine tokens/s", counts[0] / off, counts[1] / on, (on / counts[1]) / (off / counts[0]))]


def trainer_rows(ckpt: str, rounds: int, vocab: int):
    from transformers import AutoModelForCausalLM

    from rl_plugin.backends.fsdp.packing import packed_causal_mask
    from rl_plugin.invariant.hf_patch import make_invariant

    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").eval()
    patched = make_invariant(copy.deepcopy(plain))
    lengths = [40, 64, 100, 28, 80, 50]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    ids = torch.randint(3, vocab, (1, int(cu[-1])), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = packed_causal_mask(cu, "sdpa")
    targets = ids[0].roll(-1)

    @torch.no_grad()
    def default():
        logits = plain(input_ids=ids, position_ids=positions, attention_mask=mask).logits[0]
        return torch.log_softmax(logits / 0.7, -1).gather(1, targets[:, None])

    @torch.no_grad()
    def mode():
        logits = patched(input_ids=ids, position_ids=positions).logits[0]
        return invariant.log_softmax(logits, 0.7).gather(1, targets[:, None])

    off, on = _median_pair([default, mode], rounds)
    # the mismatch: a KV-cache decode of the last token vs the full forward, per path
    same = []
    for model in (plain, patched):
        with torch.no_grad():
            full = model(input_ids=ids[:, :100]).logits[0, -1]
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :99], past_key_values=cache, use_cache=True)
            step = model(input_ids=ids[:, 99:100], past_key_values=cache, use_cache=True).logits[0, -1]
        same.append(f"{float((full - step).abs().max()):.1e}")
    return [(f"trainer forward + log-probs ({int(cu[-1])} tokens), ms", off * 1e3, on * 1e3, on / off)], same


def op_rows(rounds: int, hidden: int, mlp: int, vocab: int):
    g = torch.Generator().manual_seed(2)
    rows = []
    for name, n in (("MLP up", mlp), ("LM head", vocab)):
        w = torch.randn(n, hidden, generator=g) / hidden**0.5
        for m in (1, 16, 512) if name == "MLP up" else (1, 16):
            x = torch.randn(m, hidden, generator=g)
            off, on = _median_pair([lambda: F.linear(x, w), lambda: invariant.linear(x, w)], rounds * 4)
            rows.append((f"linear {name} {m}x{hidden}->{n}, ms", off * 1e3, on * 1e3, on / off))
    heads, kv, dim, t = 9, 3, 64, 512
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv, kv))
    starts, pos = invariant.packed_positions(torch.tensor([0, t]), t)

    def sdpa():
        qh, kh, vh = (a.transpose(0, 1)[None] for a in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

    off, on = _median_pair([sdpa, lambda: invariant.attention(q, k, v, starts, pos, dim**-0.5)], rounds)
    rows.append((f"attention {t} tokens, {heads}/{kv} heads, ms", off * 1e3, on * 1e3, on / off))
    z = torch.randn(64, vocab, generator=g)
    off, on = _median_pair([lambda: torch.log_softmax(z / 0.7, -1), lambda: invariant.log_softmax(z, 0.7)], rounds * 4)
    rows.append((f"log_softmax 64 x {vocab}, ms", off * 1e3, on * 1e3, on / off))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4, help="layers of the SmolLM2-shaped model (SmolLM2 has 30)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=["embedded", "smollm2_shape"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    header = f"{'shape':<14} {'measure':<52} {'default':>10} {'mode':>10} {'time ratio':>13}"
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            ckpt = checkpoint(shape, Path(tmp), args.layers)
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(ckpt)
            rows = engine_rows(ckpt, args.rounds, cfg.vocab_size)
            trainer, same = trainer_rows(ckpt, args.rounds, cfg.vocab_size)
            rows += trainer
            if shape != "embedded":
                rows += op_rows(args.rounds, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size)
            print(header)
            for name, off, on, ratio in rows:
                print(f"{shape:<14} {name:<52} {off:>10.2f} {on:>10.2f} {ratio:>13.2f}")
            print(f"{shape:<14} decode vs full-sequence logits, max |diff|: default {same[0]}, mode {same[1]}\n")


if __name__ == "__main__":
    main()
