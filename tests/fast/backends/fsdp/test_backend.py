"""FSDP backend: one step is the same for every DP x micro-batch layout, and equals the naive
single-process reference (real FSDP2 on gloo, tiny Qwen2, fp32).

Layouts: DP=1 with one micro-batch and with --micro-batch-size 2; DP=2 (samples split 5/4, a
prompt group straddling the ranks, so rank 1 runs an idle pass) with --micro-batch-size 1, with
a token budget, and padded bshd rows (--qkv-format bshd, --micro-batch-size 3). For every --loss-aggregation mode with PPO clip, GSPO (token_mean) and
PPO dual clip with the KL + entropy terms, and token-level masked IS (--use-tis --tis-mode mask): step-1 loss (J), grad norm, every metric, the per-token log-probs and the
weight update (after AdamW) agree within ``tolerance.FP32_MODEL`` (fp32 rounding, scaled by the
log-probs and advantages whose terms cancel in J and the metrics); J and the grad norm also equal an autograd
reference built from ``tests/support/reference.py`` on the unsharded HF model (exact dJ/dtheta:
FSDP's DP averaging is cancelled). One spawn per world size runs every mode.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import reference as ref
from tests.support.fsdp_common import (
    alone_log_probs,
    fsdp_flags,
    make_step,
    parse,
    rel_err,
    step_batch,
)
from tests.support.tolerance import FP32_MODEL, max_abs, tensor_within, within

EPS, EPS_HIGH, DUAL_C, DIVISOR, KL_COEF, ENT_COEF = 0.2, 0.28, 3.0, 8.0, 0.1, 0.01
TIS_BAND = (0.8, 1.25)
CONFIGS = {
    "sample_mean": [],
    "token_mean": ["--loss-aggregation", "token_mean"],
    "prompt_mean": ["--loss-aggregation", "prompt_mean"],
    "constant": ["--loss-aggregation", "constant", "--loss-aggregation-divisor", str(DIVISOR)],
    "gspo_token_mean": ["--advantage-estimator", "gspo", "--loss-aggregation", "token_mean"],
    "dual_clip_kl_entropy": [
        "--eps-clip-high",
        str(EPS_HIGH),
        "--eps-clip-c",
        str(DUAL_C),
        "--use-kl-loss",
        "--kl-loss-coef",
        str(KL_COEF),
        "--entropy-coef",
        str(ENT_COEF),
        "--pg-metrics",
        "with_entropy",
    ],
    # token-level masked IS (IcePop) against engine log-probs = old + noise(0.15): ~1 token in 7 leaves the band
    "tis_token_mask": [
        "--use-tis",
        "--tis-mode",
        "mask",
        "--tis-clip-low",
        str(TIS_BAND[0]),
        "--tis-clip",
        str(TIS_BAND[1]),
    ],
}
LAYOUTS = {
    1: {"dp1_mb9": ["--micro-batch-size", "9"], "dp1_mb2": ["--micro-batch-size", "2"]},
    2: {
        "dp2_mb1": ["--micro-batch-size", "1"],
        "dp2_tok24": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"],
        "dp2_mb3_bshd": ["--micro-batch-size", "3", "--qkv-format", "bshd"],
    },
}
# Adam's first update is lr * g / (|g| + eps): with eps = 1e-2 it is ~linear in g (so it compares
# the gradients element-wise) and, at lr 0.1, far above the fp32 rounding of the weights.
COMMON = ["--adam-eps", "1e-2", "--lr", "0.1"]


def with_policy_log_probs(ckpt: str, step: dict) -> dict:
    """Old / reference log-probs = the model's own log-probs + fixed noise (ratios near 1, some clipped)."""
    from rl_plugin.backends.fsdp.model import load_hf_model

    model = load_hf_model(ckpt, attn_implementation="eager").eval()
    with torch.no_grad():
        logp = alone_log_probs(model, step_batch(step)).float()
    g = torch.Generator().manual_seed(11)
    step = dict(step)
    step["old_log_probs"] = logp + 0.15 * torch.randn(logp.shape, generator=g)
    step["ref_log_probs"] = logp + 0.1 * torch.randn(logp.shape, generator=g)
    step["rollout_log_probs"] = step["old_log_probs"] + 0.15 * torch.randn(logp.shape, generator=g)  # the engine's
    return step


def worker(rank, world, ckpt, step):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    local = step_batch(step).select(split_samples_for_dp(9, world)[rank])
    results = {}
    for cname, cflags in CONFIGS.items():
        for lname, lflags in LAYOUTS[world].items():
            backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *COMMON, *cflags, *lflags)))
            logp = backend.compute_log_probs(local)
            report = backend.train_step(local, num_groups=3)
            weights = backend.export_hf_state_dict()
            results[(cname, lname)] = dict(report=report, logp=logp, weights=weights if rank == 0 else None)
    return results


def reference_step(ckpt: str, step: dict, cname: str):
    """(J, grad norm, log-probs) by autograd through the unsharded HF model, loops per sample."""
    from rl_plugin.backends.fsdp.model import load_hf_model

    model = load_hf_model(ckpt, attn_implementation="eager")
    batch = step_batch(step)
    logp = alone_log_probs(model, batch)
    ent = entropies(model, batch)
    lengths, groups, mask = batch.response_lengths.tolist(), batch.group_ids, batch.loss_mask.double()
    old, adv = batch.old_log_probs.double(), batch.advantages.double()
    mode = {
        "token_mean": "token_mean",
        "prompt_mean": "prompt_mean",
        "constant": "constant",
        "gspo_token_mean": "token_mean",
    }.get(cname, "sample_mean")
    if cname.startswith("gspo"):
        tok = ref.gspo_tokens(logp, old, adv, mask, lengths, EPS, EPS)
    else:
        dual = cname == "dual_clip_kl_entropy"
        tok = ref.ppo_tokens(logp, old, adv, EPS, EPS_HIGH if dual else EPS, DUAL_C if dual else None)
    if cname == "tis_token_mask":
        w = ref.tis_weights(old, batch.rollout_log_probs.double(), mask, lengths, "token", "mask", *TIS_BAND)
        assert 0 < int(((w == 0) & (mask > 0)).sum()) < int((mask > 0).sum()), "the band must drop some tokens, not all"
        tok = tok * w
    j = ref.objective(tok, mask, lengths, groups, mode, DIVISOR)
    if cname == "dual_clip_kl_entropy":
        j = j + KL_COEF * ref.objective(
            ref.low_var_kl(logp, batch.ref_log_probs.double()), mask, lengths, groups, "sample_mean"
        )
        j = j - ENT_COEF * ref.objective(ent, mask, lengths, groups, "sample_mean")
    j.backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return float(j.detach()), norm, logp.detach()


def entropies(model, batch) -> torch.Tensor:
    out, start = [], 0
    for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
        ids = batch.tokens[start : start + t]
        start += t
        if r:
            logits = model(input_ids=ids.view(1, -1), use_cache=False).logits[0, t - r - 1 : t - 1]
            lp = torch.log_softmax(logits.double(), -1)
            out.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(out)


def rel(a, b) -> float:
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-30)


def close(a, b, scale: float) -> bool:
    """fp32 step results: every loss term and metric is built from per-token log-probs and
    advantages of magnitude <= ``scale``, so rounding is bounded by FP32_MODEL * scale, not by the
    (possibly near-zero) value: ppo_kl ~ 7e-3 is a mean of log-prob differences of ~5."""
    return within(a, b, rtol=FP32_MODEL, scale=scale)


@pytest.fixture(scope="module")
def runs(run_world, tiny_checkpoint):
    ckpt = tiny_checkpoint()
    step = with_policy_log_probs(ckpt, make_step(0))
    merged = {}
    for world in (1, 2):
        per_rank = run_world(worker, world, ckpt, step)
        for key in per_rank[0]:
            r0 = per_rank[0][key]
            for other in per_rank[1:]:  # every rank reports the same step
                assert other[key]["report"] == r0["report"], key
            merged[key] = dict(
                report=r0["report"], weights=r0["weights"], logp=torch.cat([r[key]["logp"] for r in per_rank])
            )
    from safetensors.torch import load_file

    initial = load_file(f"{ckpt}/model.safetensors")
    return ckpt, step, merged, initial


@pytest.mark.parametrize("cname", list(CONFIGS))
def test_layouts_agree_and_match_reference(runs, cname):
    ckpt, step, merged, initial = runs
    base = merged[(cname, "dp1_mb9")]
    j_ref, norm_ref, logp_ref = reference_step(ckpt, step, cname)
    scale = max_abs(logp_ref, step["old_log_probs"], step["ref_log_probs"], step["advantages"])
    assert close(base["report"]["loss"], j_ref, scale), (base["report"]["loss"], j_ref)
    assert within(base["report"]["grad_norm"], norm_ref, rtol=FP32_MODEL), (base["report"]["grad_norm"], norm_ref)
    assert tensor_within(base["logp"], logp_ref, rtol=FP32_MODEL)
    assert base["report"]["grad_norm"] > 1e-3  # the step does move the weights
    print(
        f"\n{cname}: vs reference: loss {rel(base['report']['loss'], j_ref):.1e} grad_norm "
        f"{rel(base['report']['grad_norm'], norm_ref):.1e} logp {rel_err(base['logp'], logp_ref):.1e}"
    )
    layouts = [name for names in LAYOUTS.values() for name in names if name != "dp1_mb9"]
    for lname in layouts:
        got = merged[(cname, lname)]
        print(
            f"  {lname} vs dp1_mb9: loss {rel(got['report']['loss'], base['report']['loss']):.1e} grad_norm "
            f"{rel(got['report']['grad_norm'], base['report']['grad_norm']):.1e} logp {rel_err(got['logp'], base['logp']):.1e}"
        )
        for k, v in base["report"].items():
            if k != "num_micro_batches":  # the layout itself
                assert close(got["report"][k], v, scale), (lname, k, got["report"][k], v)
        assert tensor_within(got["logp"], base["logp"], rtol=FP32_MODEL), lname
        for name, w in base["weights"].items():
            if name not in initial:
                continue  # a tied alias
            delta_base, delta = w - initial[name], got["weights"][name] - initial[name]
            if delta_base.abs().max() > 0:
                assert tensor_within(delta, delta_base, rtol=FP32_MODEL), (lname, name, rel_err(delta, delta_base))
            else:
                assert delta.abs().max() == 0, (lname, name)
