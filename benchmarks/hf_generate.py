"""Benchmark: the hf engine's lean sampler vs ``model.generate``, interleaved in one process.

For each shape (the embedded run's: 16 prompts x 8 samples of ``<bos> d d d <sep>``, 4 new
tokens, the tiny Qwen2; and a larger random-initialised Qwen2 with longer prompts and responses)
it times, in alternating order round after round, the same seeded calls:

- sampler: ``hf_sampler.sample_with_generate`` (model.generate + log-probs from its stacked
  logits, the engine's former path) vs ``hf_sampler.sample`` (the lean loop);
- engine: ``HFEngine.generate`` (bucketing, seeding, ``Generation`` assembly) with the sampler
  forced to model.generate vs the lean one;
- assembly: the ``Generation`` list of one bucket, the engine's former per-sample tensor slicing
  (``per_row_generations`` below) vs ``hf_engine.bucket_generations``;

and prints the medians in ms and the ratio before / after (> 1: the new path is faster), after
checking both give bitwise the same tokens, log-probs and Generations. One torch thread, as the engine actor
runs. Not a test: numbers depend on the machine and its load (compare only within one run).

    python benchmarks/hf_generate.py [--rounds 30] [--shapes embedded larger]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # name: model config (None: the embedded tiny model), prompts, samples per prompt, prompt length, new tokens
    "embedded": dict(model=None, prompts=16, samples=8, prompt_len=5, new_tokens=4),
    "larger": dict(
        model=dict(
            vocab_size=4096,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=704,
            max_position_embeddings=2048,
        ),
        prompts=4,
        samples=8,
        prompt_len=16,
        new_tokens=16,
    ),
}


def _checkpoint(cfg, root: Path) -> str:
    if cfg is None:
        from rl_plugin.loop.embedded import cache_root, ensure_tiny_model

        return str(ensure_tiny_model(cache_root()))
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(root / "larger", "qwen2", seed=0, **cfg))


def _prompts(shape, vocab: int):
    """``prompts`` distinct prompts ``<bos> x... <sep>`` (ids 4.. as the char tokenizer's digits),
    each repeated ``samples`` times, as a rollout asks the engine."""
    g = torch.Generator().manual_seed(0)
    high = 14 if vocab == 16 else vocab  # the embedded model: the 10 digit ids
    body = torch.randint(4, high, (shape["prompts"], shape["prompt_len"] - 2), generator=g)
    return [[1] + row + [3] for row in body.tolist() for _ in range(shape["samples"])]


def per_row_generations(prompts, tokens, log_probs, eos):
    """The engine's assembly before the lean sampler (the baseline): tensor slicing per sample."""
    from rl_plugin.rollout.engine import Generation

    is_eos = torch.isin(tokens, eos)
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(tokens[:, 0], tokens.shape[1]))
    out = []
    for row, prompt in enumerate(prompts):
        n = int(first_eos[row])
        out.append(
            Generation(list(prompt), tokens[row, :n].tolist(), log_probs[row, :n].tolist(), bool(is_eos[row, :n].any()))
        )
    return out


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_shape(name: str, shape: dict, rounds: int, root: Path):
    import rl_plugin.rollout.hf_engine as hf_engine
    from rl_plugin.rollout.engine import SamplingParams
    from rl_plugin.rollout.hf_sampler import lean_sampling_blocker, sample, sample_with_generate

    eng = hf_engine.HFEngine(_checkpoint(shape["model"], root))
    prompts = _prompts(shape, eng.model.config.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=shape["new_tokens"])
    if lean_sampling_blocker(eng.model, params.temperature, params.top_p, params.max_new_tokens):
        raise RuntimeError(f"{name}: the lean sampler does not apply to this model")
    ids = torch.tensor(prompts)
    kw = dict(
        temperature=params.temperature,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
        eos_token_ids=eng.eos_token_ids,
        pad_token_id=eng.pad_token_id,
    )

    def seeded(fn):
        torch.manual_seed(0)
        return fn(eng.model, ids, **kw)

    def engine_with(blocker):
        def call():
            eng.lean_blocker = blocker  # "forced": model.generate; None: the lean loop
            return eng.generate(prompts, params, seed=0)

        return call

    tokens, log_probs = seeded(sample)
    eos = torch.tensor(eng.eos_token_ids)
    pairs = {
        "sampler": (lambda: seeded(sample_with_generate), lambda: seeded(sample)),
        "engine.generate": (engine_with("forced"), engine_with(None)),
        "assembly": (
            lambda: per_row_generations(prompts, tokens, log_probs, eos),
            lambda: hf_engine.bucket_generations(prompts, tokens, log_probs, eos),
        ),
    }
    (t0, l0), (t1, l1) = pairs["sampler"][0](), pairs["sampler"][1]()
    same = torch.equal(t0, t1) and torch.equal(l0, l1)
    same = same and all(slow() == fast() for slow, fast in list(pairs.values())[1:])
    rows = []
    for what, (slow, fast) in pairs.items():
        for _ in range(2):  # warm-up
            slow(), fast()
        a, b = [], []
        for r in range(rounds):  # alternate the order so drift and caching favour neither
            if r % 2:
                a.append(_time(slow)), b.append(_time(fast))
            else:
                b.append(_time(fast)), a.append(_time(slow))
        rows.append((name, len(prompts), shape["prompt_len"], shape["new_tokens"], what, a, b, same))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="hf_generate_"))
    rows = [row for name in a.shapes for row in run_shape(name, SHAPES[name], a.rounds, root)]
    print(
        f"{'shape':9} {'batch':>5} {'prompt':>6} {'new':>4} {'what':16} {'before ms':>10} {'after ms':>9} "
        f"{'ratio':>6} {'bitwise':>7}"
    )
    for name, batch, plen, new, what, slow, fast, same in rows:
        s, f = statistics.median(slow) * 1e3, statistics.median(fast) * 1e3
        print(
            f"{name:9} {batch:5d} {plen:6d} {new:4d} {what:16} {s:10.3f} {f:9.3f} {s / f:6.2f} {'yes' if same else 'NO':>7}"
        )
    print(
        f"medians of {a.rounds} interleaved rounds, 1 torch thread; before: model.generate / per-sample "
        "assembly, after: the lean sampler / bucket_generations; ratio = before / after"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
