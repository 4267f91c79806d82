"""Benchmark: the hf engine's lean sampler, with and without the shared prompt prefill, vs ``model.generate``.

For each shape (the embedded run's: 16 prompts x 8 samples of ``<bos> d d d <sep>``, 4 new
tokens, the tiny Qwen2; and a larger random-initialised Qwen2 with longer prompts and responses)
it times, in rotating order round after round, the same seeded calls:

- sampler: ``hf_sampler.sample_with_generate`` (model.generate + log-probs from its stacked
  logits, the engine's former path) vs ``hf_sampler.sample`` with the full-batch prefill
  (``share_prompt_prefill=False``: every row, as generate) vs ``sample`` with the shared prefill
  (the default: each distinct prompt once, its KV cache and logits copied to its n samples);
- engine: ``HFEngine.generate`` (bucketing, seeding, ``Generation`` assembly) with the same three
  samplers;
- assembly: the ``Generation`` list of one bucket, the engine's former per-sample tensor slicing
  (``per_row_generations`` below) vs ``hf_engine.bucket_generations``;

and prints the medians in ms and the ratios (> 1: the later path is faster), with whether the
paths gave bitwise the same tokens, log-probs and Generations here (lean vs generate; shared vs
lean, which another machine's GEMMs may round differently). One torch thread, as the engine
actor runs. Not a test: numbers depend on the machine and its load (compare only within one run).

    python -m benchmarks.hf_generate [--rounds 30] [--shapes embedded larger]
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
        from rl_plugin.loop.embedded_setup import cache_root, ensure_tiny_model

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
    from rl_plugin.rollout.engines.base import Generation

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


def _interleaved(fns, rounds: int):
    """Per function, the times of ``rounds`` calls, the order rotated every round so drift and
    caching favour none (after two warm-up rounds)."""
    for _ in range(2):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for r in range(rounds):
        for k in [(r + j) % len(fns) for j in range(len(fns))]:
            times[k].append(_time(fns[k]))
    return times


def run_shape(name: str, shape: dict, rounds: int, root: Path):
    """(sampler rows, assembly row) of one shape: medians in ms and the bitwise checks."""
    import rl_plugin.rollout.engines.hf_engine as hf_engine
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_sampler import lean_sampling_blocker, sample, sample_with_generate

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

    def seeded(share):
        def call():
            torch.manual_seed(0)
            if share is None:
                return sample_with_generate(eng.model, ids, **kw)
            return sample(eng.model, ids, share_prompt_prefill=share, **kw)

        return call

    def engine_with(share):
        def call():
            eng.lean_blocker = "forced" if share is None else None  # "forced": model.generate
            eng.share_prompt_prefill = bool(share)
            return eng.generate(prompts, params, seed=0)

        return call

    variants = (None, False, True)  # model.generate, lean full-batch prefill, lean shared prefill
    sampler_rows = []
    for what, make in (("sampler", seeded), ("engine.generate", engine_with)):
        fns = [make(v) for v in variants]
        gen, lean, shared = (fn() for fn in fns)
        if what == "sampler":
            lean_same = all(torch.equal(a, b) for a, b in zip(gen, lean))
            shared_same = all(torch.equal(a, b) for a, b in zip(lean, shared))
            tokens, log_probs = shared
        else:
            lean_same, shared_same = gen == lean, lean == shared
        times = _interleaved(fns, rounds)
        sampler_rows.append(
            (name, len(prompts), shape["prompts"], shape["prompt_len"], shape["new_tokens"], what)
            + tuple(statistics.median(t) * 1e3 for t in times)
            + (lean_same, shared_same)
        )
    eos = torch.tensor(eng.eos_token_ids)
    before = lambda: per_row_generations(prompts, tokens, log_probs, eos)  # noqa: E731
    after = lambda: hf_engine.bucket_generations(prompts, tokens, log_probs, eos)  # noqa: E731
    slow, fast = _interleaved([before, after], rounds)
    assembly = (name, len(prompts), statistics.median(slow) * 1e3, statistics.median(fast) * 1e3, before() == after())
    return sampler_rows, assembly


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="hf_generate_"))
    results = [run_shape(name, SHAPES[name], a.rounds, root) for name in a.shapes]
    print(
        f"{'shape':9} {'batch':>5} {'distinct':>8} {'prompt':>6} {'new':>4} {'what':16} {'generate ms':>11} "
        f"{'lean ms':>8} {'shared ms':>9} {'gen/lean':>8} {'lean/shared':>11} {'gen/shared':>10} "
        f"{'lean==gen':>9} {'shared==lean':>12}"
    )
    for rows, _ in results:
        for name, batch, distinct, plen, new, what, g, lean, shared, lean_same, shared_same in rows:
            print(
                f"{name:9} {batch:5d} {distinct:8d} {plen:6d} {new:4d} {what:16} {g:11.3f} {lean:8.3f} {shared:9.3f} "
                f"{g / lean:8.2f} {lean / shared:11.2f} {g / shared:10.2f} {_yes(lean_same):>9} {_yes(shared_same):>12}"
            )
    print(
        f"medians of {a.rounds} rotated rounds, 1 torch thread; generate: model.generate, lean: the lean sampler "
        "with the full-batch prefill, shared: with each distinct prompt prefilled once (the default); "
        "X/Y = X ms / Y ms; ==: bitwise equal on this machine"
    )
    print()
    print(f"{'shape':9} {'batch':>5} {'per-sample ms':>13} {'bucket ms':>9} {'ratio':>6} {'equal':>5}")
    for _, (name, batch, slow, fast, same) in results:
        print(f"{name:9} {batch:5d} {slow:13.3f} {fast:9.3f} {slow / fast:6.2f} {_yes(same):>5}")
    print(
        "assembly of one bucket's Generations: per_row_generations (the former per-sample tensor slicing) vs "
        "hf_engine.bucket_generations; ratio = per-sample / bucket"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
