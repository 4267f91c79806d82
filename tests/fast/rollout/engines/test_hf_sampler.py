"""The hf engine's lean sampler (``rl_plugin.rollout.engines.hf_sampler.sample``) against ``model.generate``.

Bitwise: with the full-batch prefill (``share_prompt_prefill=False``) both run the same model on
the same inputs and draw from the same global RNG, so the tokens, the fp32 log-probs and the RNG
state afterwards must be identical (``torch.equal``), including rows padded after their eos (they
still draw) and the early stop once every row ended. The shared prefill (each distinct prompt
once, the default) is checked against the full-batch one: same tokens and RNG use, log-probs
within fp32 rounding (its GEMMs run on fewer rows, which may round differently on other hardware).
"""

import json
import shutil
from contextlib import contextmanager
from functools import partial

import pytest
import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.engines.base import SamplingParams, make_engine
from rl_plugin.rollout.engines.hf_sampler import distinct_prompts, lean_sampling_blocker, sample, sample_with_generate

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("sampler") / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64
    )


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def _prompts(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cat(
        [torch.ones(batch, 1, dtype=torch.long), torch.randint(3, 16, (batch, length - 1), generator=g)], 1
    )


def _both(model, prompts, seed, **kw):
    """(tokens, log_probs, next RNG draw) of generate and of the lean loop (full-batch prefill)
    from the same seed."""
    runs = []
    for fn in (sample_with_generate, partial(sample, share_prompt_prefill=False)):
        torch.manual_seed(seed)
        tokens, logp = fn(model, prompts, **kw)
        runs.append((tokens, logp, torch.rand(4)))  # the RNG state after: same number of draws
    return runs


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (1.3, 0.6)])
def test_lean_sampler_equals_generate_bitwise(model, temperature, top_p):
    """Every (T == 1 or not) x (top-p or not), several seeds, several eos ids: same tokens,
    log-probs and RNG state; some rows end early and are padded while others run on."""
    prompts = _prompts(24, 5)
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=6, eos_token_ids=[EOS, 7], pad_token_id=PAD)
    padded = 0
    for seed in range(3):
        (t0, l0, r0), (t1, l1, r1) = _both(model, prompts, seed, **kw)
        assert t0.shape == (24, 6) and torch.equal(t0, t1) and torch.equal(l0, l1) and torch.equal(r0, r1)
        assert l1.dtype == torch.float32
        padded += int((t1 == PAD).sum())
    assert padded > 0  # rows finished before the last step were padded (and kept drawing)


def test_lean_sampler_stops_when_every_row_ended(model):
    """With most of the vocabulary as eos ids all rows end before max_new_tokens: both stop at
    the same step, with rows finished at different steps (padded in between)."""
    prompts = _prompts(16, 4, seed=1)
    kw = dict(temperature=0.9, top_p=0.9, max_new_tokens=16, eos_token_ids=list(range(2, 12)), pad_token_id=PAD)
    for seed in range(3):
        (t0, l0, r0), (t1, l1, r1) = _both(model, prompts, seed, **kw)
        assert 1 < t1.shape[1] < 16  # the early stop happened, after more than one step
        assert (t1[:, -1] != PAD).any() and (t1 == PAD).any()
        assert torch.equal(t0, t1) and torch.equal(l0, l1) and torch.equal(r0, r1)


def test_top_p_drops_the_token_whose_cumulative_mass_is_exactly_1_minus_top_p(model):
    """At the nucleus boundary: with 1 - top_p equal to the (fp32) cumulative probability of the
    4 least likely tokens, those 4 are dropped (transformers: ``cumulative <= 1 - top_p``), the
    4th included. Every row has the same prompt, so the first step's distribution is one row's."""
    prompts = _prompts(1, 5, seed=4).repeat(64, 1)
    first = model.generate(
        input_ids=prompts, do_sample=False, max_new_tokens=1, output_logits=True, return_dict_in_generate=True
    )  # the first step's raw logits, computed on exactly the sampler's inputs
    scaled = first.logits[0][0] / 0.8
    ascending, order = torch.sort(scaled)
    top_p = 1.0 - float(ascending.softmax(-1).cumsum(-1)[3])  # exact in fp64: 1 - (1 - c) == c
    dropped = set(order[:4].tolist())
    kw = dict(temperature=0.8, top_p=top_p, max_new_tokens=2, eos_token_ids=[EOS], pad_token_id=PAD)
    (t0, l0, r0), (t1, l1, r1) = _both(model, prompts, 5, **kw)
    assert torch.equal(t0, t1) and torch.equal(l0, l1) and torch.equal(r0, r1)
    assert not dropped & set(t1[:, 0].tolist())


# Shared vs full-batch prefill: fp32 log-probs of magnitude ~1-10 (vocab 16, T >= 0.7). A GEMM
# rounding differently for another row count moves a logit by a few ulp of its O(1-10) terms and a
# log-prob by ~1e-6 (the decode steps then read KV rows off by as much); 1e-5 bounds that with
# margin and stays far below what a different token or prompt changes (~1e-2).
SHARED_ATOL = 1e-5


@contextmanager
def forward_rows(model):
    """The row count of each forward's ``input_ids`` (the first: the prefill) while in the block."""
    rows = []
    handle = model.register_forward_pre_hook(
        lambda _module, _args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        yield rows
    finally:
        handle.remove()


def _shared_and_full(model, prompts, seed, **kw):
    """(tokens, log_probs, next RNG draw, forward rows) of the full-batch then the shared prefill
    (``sample``'s default)."""
    runs = []
    for fn in (partial(sample, share_prompt_prefill=False), sample):
        torch.manual_seed(seed)
        with forward_rows(model) as rows:
            tokens, logp = fn(model, prompts, **kw)
        runs.append((tokens, logp, torch.rand(4), rows))
    return runs


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_shared_prompt_prefill_equals_the_full_batch_prefill(model, temperature, top_p):
    """A rollout's bucket with scattered repeats (5 distinct prompts over 40 rows in random order):
    the shared prefill runs the 5 distinct rows through the model, the full-batch one all 40; both
    then decode 40 rows with the same tokens and RNG use and log-probs within fp32 rounding."""
    distinct = _prompts(5, 6, seed=6)
    which = torch.randperm(40, generator=torch.Generator().manual_seed(0)) % 5
    assert len(set(which[:5].tolist())) > 1  # a prompt's copies are not contiguous
    prompts = distinct[which]
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=6, eos_token_ids=[EOS, 7], pad_token_id=PAD)
    for seed in range(3):
        (t0, l0, r0, rows0), (t1, l1, r1, rows1) = _shared_and_full(model, prompts, seed, **kw)
        assert rows0[0] == 40 and rows1[0] == 5 and rows0[1:] == rows1[1:] == [40] * (t1.shape[1] - 1)
        assert torch.equal(t0, t1) and torch.equal(r0, r1)
        torch.testing.assert_close(l1, l0, rtol=0, atol=SHARED_ATOL)
        # copies of one prompt sample independently: the rows of a prompt differ somewhere
        assert all(len({tuple(r) for r in t1[which == k].tolist()}) > 1 for k in range(5))


def test_distinct_prompts_with_scattered_repeats_and_without_any(model):
    """``distinct_prompts`` finds repeats in any order; a bucket of distinct prompts has nothing to
    share and runs the full-batch prefill itself (the same code: bitwise)."""
    a, b, c = _prompts(3, 4, seed=8).tolist()
    x = torch.tensor([b, a, c, a, b, b])
    unique, inverse = distinct_prompts(x)
    assert unique.shape == (3, 4) and inverse.shape == (6,) and torch.equal(unique[inverse], x)
    prompts = _prompts(12, 5, seed=9)
    assert len({tuple(r) for r in prompts.tolist()}) == 12 and distinct_prompts(prompts) is None
    kw = dict(temperature=0.9, top_p=0.9, max_new_tokens=5, eos_token_ids=[EOS], pad_token_id=PAD)
    (t0, l0, r0, rows0), (t1, l1, r1, rows1) = _shared_and_full(model, prompts, 2, **kw)
    assert rows0 == rows1 and rows1[0] == 12
    assert torch.equal(t0, t1) and torch.equal(l0, l1) and torch.equal(r0, r1)


def test_engine_generate_equals_generate_over_prompt_lengths(checkpoint):
    """HFEngine.generate (buckets of equal prompt length, each seeded; outputs assembled per
    sample) gives the same Generations with the lean sampler as with model.generate."""
    eng = make_engine(EngineConfig(engine="hf"), str(checkpoint))
    assert eng.lean_blocker is None and lean_sampling_blocker(eng.model, 0.8, 0.95, 5) is None  # lean
    eng.share_prompt_prefill = False  # the full-batch prefill, the same computation as generate
    lengths = [3, 6, 3, 4, 6, 6, 4, 3] * 3
    prompts = [p[:n] for p, n in zip(_prompts(len(lengths), 6, seed=2).tolist(), lengths)]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=5)
    lean = eng.generate(prompts, params, seed=7)
    eng.lean_blocker = "forced"  # model.generate
    ref = eng.generate(prompts, params, seed=7)
    assert lean == ref  # dataclass equality: prompt, response ids, log-prob floats, finished
    for g in lean:  # a response runs through its first eos (finished), else max_new_tokens long
        assert EOS not in g.response_ids[:-1] and len(g.log_probs) == len(g.response_ids)
        assert g.finished == (g.response_ids[-1] == EOS) and (g.finished or len(g.response_ids) == 5)
    assert {len(g.response_ids) for g in lean} != {5} and any(g.finished for g in lean)
    assert [g.prompt_ids for g in lean] == prompts


def test_engine_shares_the_prefill_of_a_rollouts_repeated_prompts(checkpoint):
    """HFEngine.generate on a rollout's prompts (3 prompts of 2 lengths, 4 samples each, as the
    manager asks): each bucket's prefill runs its distinct prompts only, and the Generations match
    the full-batch prefill's (same responses, log-probs within fp32 rounding)."""
    eng = make_engine(EngineConfig(engine="hf"), str(checkpoint))
    assert eng.share_prompt_prefill  # the default
    distinct = [p[:n] for p, n in zip(_prompts(3, 6, seed=10).tolist(), [4, 6, 4])]
    prompts = [p for p in distinct for _ in range(4)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5)
    runs = {}
    for share in (False, True):
        eng.share_prompt_prefill = share
        with forward_rows(eng.model) as rows:
            runs[share] = (eng.generate(prompts, params, seed=3), rows)
    (full, full_rows), (shared, shared_rows) = runs[False], runs[True]
    # per bucket (length 4: 8 rows of 2 prompts, then length 6: 4 rows of 1): a prefill, then the
    # decode steps on all the bucket's rows
    steps4, steps6 = full_rows.count(8), full_rows.count(4)
    assert full_rows == [8] * steps4 + [4] * steps6 and steps4 > 1 and steps6 > 1
    assert shared_rows == [2] + [8] * (steps4 - 1) + [1] + [4] * (steps6 - 1)
    assert [g.prompt_ids for g in shared] == prompts
    assert [(g.response_ids, g.finished) for g in shared] == [(g.response_ids, g.finished) for g in full]
    got, ref = (torch.tensor([x for g in gens for x in g.log_probs]) for gens in (shared, full))
    torch.testing.assert_close(got, ref, rtol=0, atol=SHARED_ATOL)


def test_a_generation_config_sample_cannot_match_falls_back_to_generate(checkpoint, tmp_path):
    """A checkpoint asking for a repetition penalty: the lean loop would ignore it, so the engine
    samples with model.generate, as before."""
    other = tmp_path / "penalised"
    shutil.copytree(checkpoint, other)
    cfg = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**cfg, "repetition_penalty": 1.5}))
    eng = make_engine(EngineConfig(engine="hf"), str(other))
    assert eng.lean_blocker == "the generation config sets repetition_penalty=1.5"
    assert lean_sampling_blocker(eng.model, 1, 1.0, 4) == "temperature 1 is not a positive float"
    prompts = _prompts(16, 4, seed=3)
    kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=6, eos_token_ids=[EOS], pad_token_id=PAD)
    (t0, _, _), (t1, _, _) = _both(eng.model, prompts, 0, **kw)
    assert not torch.equal(t0, t1)  # the penalty changes what generate samples
    gens = eng.generate(prompts.tolist(), SamplingParams(1.0, 1.0, 6), seed=0)
    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(0))))
    tokens, _ = sample_with_generate(eng.model, prompts, **kw)
    assert [g.response_ids for g in gens] == [row[: len(g.response_ids)] for row, g in zip(tokens.tolist(), gens)]
