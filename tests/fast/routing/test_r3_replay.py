"""R3 (``--use-rollout-routing-replay``): the trainer routes every token to the experts the engine
routed it to, so its step-0 log-probs equal the engine's even where the routers disagree.

The engine's routers are made to disagree on purpose (``routing.hf.install_routing_flip``, the
hook of ``--debug-engine-routing-flip``): about a third of the tokens go to their 1st and 3rd
choice instead of their top-2 (the mixing weights recomputed at those experts, as a router that
had chosen them would), the way a different kernel or a near tie flips a real engine's top-k.
The engine records the experts it used.
Each trainer (FSDP: the HF routers; Megatron: megatron-core's ``RouterReplay``; the same weights)
then computes the old log-probs of that rollout and takes a train step:

- without R3 its routers pick their own top-2: log-probs differ from the engine's by O(0.1);
- with R3 they take the recorded experts: the log-probs equal the engine's to fp32 rounding
  (the engine ran prefill + KV-cached decoding, the trainer one packed forward), and the train
  step reports ``routing/topk_agree_frac`` ~ 2/3 (a third of each layer's tokens flipped).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.samples import samples_of
from tests.support.tolerance import FP32_MODEL

BACKENDS = ("fsdp", "megatron")
LOGP_SCALE = 8.0  # |log-prob| of the tiny model's tokens (vocab 128: ~ -5), rounded up


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    return str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe"))


@pytest.fixture(scope="module")
def rollout(moe_ckpt):
    """The disagreeing engine's rollout: 3 prompts x 2 samples, flat, with its routed experts."""
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine
    from rl_plugin.rollout.flatten import flatten_samples
    from rl_plugin.routing.hf import install_routing_flip

    torch.manual_seed(0)
    engine = HFEngine(moe_ckpt, record_routed_experts=True)
    install_routing_flip(engine.model, 1 / 3)
    prompts = [p for p in ([5, 6, 7], [9, 10, 11, 12], [20, 21]) for _ in range(2)]
    gens = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10), seed=3)
    return flatten_samples(samples_of(gens))


def _batch(flat):
    from rl_plugin.loss import StepBatch

    r = int(flat.response_lengths.sum())
    return StepBatch(
        tokens=flat.tokens,
        total_lengths=flat.total_lengths,
        response_lengths=flat.response_lengths,
        loss_mask=torch.ones(r),
        advantages=torch.linspace(-1, 1, r),
        group_ids=torch.arange(flat.total_lengths.numel()) // 2,
        rollout_log_probs=flat.log_probs,
        routed_experts=flat.routed_experts,
    )


def _worker(rank, world, ckpt, flat):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    out = {}
    bshd = ["--qkv-format", "bshd", "--seq-length", "16"]
    runs = [(b, mode, []) for b in BACKENDS for mode in (None, "r3", "r2")] + [("megatron", "r3", bshd)]
    for name, mode, extra in runs:
        flags = ["--train-backend", name, "--hf-checkpoint", ckpt, "--lr", "1e-3", *extra]
        flags += {None: [], "r3": ["--use-rollout-routing-replay"], "r2": ["--use-routing-replay"]}[mode]
        cls = FSDPBackend if name == "fsdp" else MegatronBackend
        backend = cls.from_args(make_args(*flags, world_size=world))
        batch = _batch(flat)
        if mode != "r3":
            batch.routed_experts = None  # only R3 reads the engine's record
        old = backend.compute_log_probs(batch)  # R2: records the trainer's own routing into the batch
        batch.old_log_probs = old
        report = backend.train_step(batch, num_groups=3)
        out[name, mode, bool(extra)] = dict(logp=old, report=report, recorded=batch.routed_experts)
    return out


@pytest.fixture(scope="module")
def trained(run_world, moe_ckpt, rollout):
    return run_world(_worker, 1, moe_ckpt, rollout)[0]


def test_engine_records_every_token_it_ran(rollout):
    assert rollout.routed_experts.shape == (int(rollout.total_lengths.sum()), 2, 2)
    assert rollout.routed_experts.dtype == torch.int16


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_r3_the_routers_disagree_and_log_probs_differ(trained, rollout, backend):
    diff = (trained[backend, None, False]["logp"] - rollout.log_probs).abs()
    print(
        f"{backend} without R3: |trainer - engine| log-prob mean {float(diff.mean()):.3e} max {float(diff.max()):.3e}"
    )
    assert float(diff.max()) > 1e-2
    assert "routing/topk_agree_frac" not in trained[backend, None, False]["report"]


@pytest.mark.parametrize("backend,bshd", [("fsdp", False), ("megatron", False), ("megatron", True)])
def test_with_r3_trainer_log_probs_equal_the_engines(trained, rollout, backend, bshd):
    diff = (trained[backend, "r3", bshd]["logp"] - rollout.log_probs).abs()
    layout = "bshd" if bshd else "thd"
    print(
        f"{backend} ({layout}) with R3: |trainer - engine| log-prob mean {float(diff.mean()):.3e} max {float(diff.max()):.3e}"
    )
    assert float(diff.max()) <= FP32_MODEL * LOGP_SCALE, float(diff.max())


def test_r3_reports_the_engine_trainer_topk_agreement(trained):
    """Every backend and layout counts the same (token, layer) pairs on the same routing."""
    fracs = {k: v["report"]["routing/topk_agree_frac"] for k, v in trained.items() if k[1] == "r3"}
    print(f"routing/topk_agree_frac with R3 (about a third of the engine's tokens flipped): {fracs}")
    frac = fracs["fsdp", "r3", False]
    assert 0.45 < frac < 0.9, frac
    assert set(fracs.values()) == {frac}


@pytest.fixture(scope="module")
def natural_routing(moe_ckpt, rollout):
    """The HF model's own top-k of every token of the rollout (no engine hook), sample by sample."""
    from transformers import AutoModelForCausalLM

    from rl_plugin.routing.hf import hf_routers

    model = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    seen = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in hf_routers(model)]
    with torch.no_grad():
        for ids in rollout.tokens.split(rollout.total_lengths.tolist()):
            model(input_ids=ids[None])
    for h in handles:
        h.remove()
    layers = len(handles)
    per_sample = [torch.stack(seen[i : i + layers], dim=1) for i in range(0, len(seen), layers)]
    return torch.cat(per_sample)


@pytest.mark.parametrize("backend", BACKENDS)
def test_r2_records_the_trainers_own_routing_and_replays_it(trained, natural_routing, backend):
    """R2: the old pass routes freely (the same log-probs as without replay) and records its
    routing (the HF model's own top-k of every token, engine disagreement or not); the training
    pass replays it at the same weights, so the routers' own top-k agrees everywhere (1.0)."""
    from rl_plugin.routing.hf import same_sets

    r2 = trained[backend, "r2", False]
    assert torch.equal(r2["logp"], trained[backend, None, False]["logp"])
    assert bool(same_sets(r2["recorded"].long(), natural_routing).all())
    assert r2["report"]["routing/topk_agree_frac"] == 1.0


def _ep_worker(rank, world, ckpt, flat):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args

    flags = [
        "--hf-checkpoint",
        ckpt,
        "--lr",
        "1e-3",
        "--use-rollout-routing-replay",
        "--expert-model-parallel-size",
        "2",
    ]
    backend = MegatronBackend.from_args(make_args(*flags, world_size=world))
    ps = backend.parallel_state
    local = dp_shard(_batch(flat), ps.dp_size, ps.dp_rank)  # each rank replays the tokens it holds
    local.old_log_probs = backend.compute_log_probs(local)
    report = backend.train_step(local, num_groups=3)
    return local.old_log_probs, local.rollout_log_probs, report["routing/topk_agree_frac"]


def test_r3_at_expert_parallel_2(run_world, moe_ckpt, rollout, trained):
    """EP = 2 (DP = 2): each rank replays its own samples' experts through the all-to-all
    dispatcher; the log-probs equal the engine's and the agreement (summed over DP) is EP = 1's."""
    for old, engine, frac in run_world(_ep_worker, 2, moe_ckpt, rollout):
        diff = float((old - engine).abs().max())
        print(f"megatron EP=2 with R3: max |trainer - engine| {diff:.3e}, topk_agree_frac {frac:.4f}")
        assert diff <= FP32_MODEL * LOGP_SCALE
        assert frac == trained["megatron", "r3", False]["report"]["routing/topk_agree_frac"]
