"""Megatron backend: the applied gradient is exactly dJ/dtheta for every layout.

One spawn per (TP, DP) layout; inside it, every case (4 aggregation modes x PPO clip / GSPO) runs
on every micro-batch split, each from the same starting state (reloaded from a checkpoint). With
plain SGD (lr 1, no momentum, no clipping) the weight update IS the applied gradient, so:

- step-1 loss, grad norm and weight update equal across TP {1,2} x DP {1,2} x splits;
- at TP1 x DP1 they also equal an independent reference: the Hugging Face model, one sample at a
  time, the loss core's single-process ``aggregate`` API, autograd.

Tolerance: ``tolerance.FP32_MODEL`` (fp32 rounding through the model), relative for the grad norm
and the update (no cancellation in a norm), and for J against the magnitude of its per-token terms
-A * exp(logp - old): their rounding is |A| * r * u|logp|, so S = max|A| * max(1, max|logp|). Invariance alone
  would not catch a layout-independent scale error; this does.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, max_abs, within

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODES = [("sample_mean",), ("token_mean",), ("prompt_mean",), ("constant", "--loss-aggregation-divisor", "8")]
POLICIES = ["grpo", "gspo"]
# TIS: engine log-probs = old + seeded noise; sequence-level masked IS on token_mean (policy "+tis").
CASES = [(m, p) for m in MODES for p in POLICIES] + [(("token_mean",), "grpo+tis")]
TIS_BAND = (0.8, 1.25)
TIS_FLAGS = [
    "--use-tis",
    "--tis-level",
    "sequence",
    "--tis-mode",
    "mask",
    "--tis-clip-low",
    str(TIS_BAND[0]),
    "--tis-clip",
    str(TIS_BAND[1]),
]
ROLLOUT_NOISE = 0.25
SPLITS = ["whole", "tokens"]
TEMPERATURE = 0.9


def _case_flags(mode, policy):
    estimator, _, tis = policy.partition("+")
    return [
        "--loss-aggregation",
        *mode,
        "--advantage-estimator",
        estimator,
        "--eps-clip",
        "0.2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-temperature",
        str(TEMPERATURE),
        *(TIS_FLAGS if tis else []),
    ]


def _with_rollout_noise(batch):
    """The engine's log-probs as an offset from the old ones, drawn for the GLOBAL batch."""
    g = torch.Generator().manual_seed(11)
    batch.rollout_log_probs = ROLLOUT_NOISE * torch.randn(batch.loss_mask.shape[0], generator=g)
    return batch


def _split(name, local, ps):
    from rl_plugin.loss.micro_batch_plan import micro_batches_by_count, plan_micro_batches

    if name == "whole":
        return [torch.arange(local.num_samples)]
    if name == "per_sample":
        return micro_batches_by_count(local.num_samples, 1)
    return plan_micro_batches(local, micro_batch_size=1, max_tokens_per_gpu=24, dp_group=ps.dp_group)


def _hf_reference(hf_dir, batch, num_groups, mode, policy):
    """(J, {hf_name: update}) from the HF model and the core's single-process API, SGD lr 1."""
    from transformers import AutoModelForCausalLM

    from rl_plugin.loss import aggregate, get_policy_loss

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tl, rl = batch.total_lengths.tolist(), batch.response_lengths.tolist()
    logps, off = [], 0
    for t, r in zip(tl, rl):  # one sample at a time: no packing, no masks to get wrong
        ids = batch.tokens[off : off + t]
        z = model(ids[None]).logits[0].float() / TEMPERATURE
        logps.append(torch.log_softmax(z[t - r - 1 : t - 1], -1).gather(1, ids[t - r :, None]).squeeze(1))
        off += t
    logp = torch.cat(logps)
    old = logp.detach() + batch.old_log_probs
    loss_fn = get_policy_loss("gspo" if policy == "gspo" else "ppo_clip")
    pg, _ = loss_fn(
        logp, old, batch.advantages, loss_mask=batch.loss_mask, response_lengths=batch.response_lengths, eps_clip=0.2
    )
    if policy.endswith("+tis"):
        from tests.support import reference as ref

        w = ref.tis_weights(
            old.detach(),
            old.detach() + batch.rollout_log_probs,
            batch.loss_mask,
            batch.response_lengths.tolist(),
            "sequence",
            "mask",
            *TIS_BAND,
        )
        assert 0 < int((w == 0).sum()) < w.numel(), "the band must mask some samples and keep others"
        pg = pg * w.to(pg.dtype)
    divisor = float(mode[2]) if len(mode) > 1 else None
    j = aggregate(pg, batch.loss_mask, batch.response_lengths, mode[0], group_ids=batch.group_ids, divisor=divisor)
    j.backward()
    return float(j), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}


def _layout_worker(rank, world, tp, hf_dir):
    from dataclasses import replace

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.loss import LossConfig
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    base = [
        "--hf-checkpoint",
        hf_dir,
        "--tensor-model-parallel-size",
        str(tp),
        *EXACT_SGD,
    ]
    backend = MegatronBackend.from_args(make_args(*base, world_size=world))
    ps = backend.parallel_state
    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    batch = _with_rollout_noise(batch)
    local0 = dp_shard(batch, ps.dp_size, ps.dp_rank)
    w0 = backend.export_hf_state_dict()
    ckpt = tempfile.mkdtemp(prefix="mgt_parity_") if rank == 0 else None
    obj = [ckpt]
    torch.distributed.broadcast_object_list(obj, src=0)
    backend.save_checkpoint(obj[0], step=0)
    out = {}
    logp0 = backend.compute_log_probs(local0)
    scale = max_abs(local0.advantages) * max(1.0, max_abs(logp0))  # see the module docstring
    for mode, policy in CASES:
        cfg = LossConfig.from_args(make_args(*base, *_case_flags(mode, policy), world_size=world))
        for split in SPLITS:
            backend.load_checkpoint(obj[0])
            backend.loss_config = cfg
            local = with_old_log_probs(local0, backend.compute_log_probs(local0))
            local = replace(local, rollout_log_probs=local.old_log_probs + local0.rollout_log_probs)
            report = backend.train_step(local, num_groups=num_groups, micro_batches=_split(split, local, ps))
            w1 = backend.export_hf_state_dict()
            out[(mode[0], policy, split)] = (report, {k: w1[k] - w0[k] for k in w0})
    # The gloo twins the backend builds for the loss core under NCCL (parallel.cpu_group): same ranks.
    from megatron.core import parallel_state as mpu

    from rl_plugin.parallel import cpu_group

    for group in (
        mpu.get_data_parallel_group(),
        mpu.get_context_parallel_group(),
        mpu.get_tensor_model_parallel_group(),
        mpu.get_data_parallel_group(with_context_parallel=True),
    ):
        twin = cpu_group(group)
        if torch.distributed.get_process_group_ranks(twin) != torch.distributed.get_process_group_ranks(group):
            raise AssertionError(f"gloo twin of {torch.distributed.get_process_group_ranks(group)} differs")
    ref = {}
    if world == 1:
        for mode, policy in CASES:
            ref[(mode[0], policy)] = _hf_reference(hf_dir, replace(batch), num_groups, mode, policy)
    return (out, ref, scale) if rank == 0 else None


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _update_rel(da, db):
    num = math.sqrt(sum(float(((da[k] - db[k]) ** 2).sum()) for k in db))
    den = math.sqrt(sum(float((db[k] ** 2).sum()) for k in db))
    return num / den


@pytest.fixture(scope="module")
def layout_results(run_world, tiny_qwen2):
    return {lay: run_world(_layout_worker, lay[0] * lay[1], lay[0], tiny_qwen2)[0] for lay in LAYOUTS}


def test_layouts_and_splits_agree(layout_results):
    ref_out, _, scale = layout_results[(1, 1)]  # the whole batch on one rank: the global scale
    worst = {}
    for lay, (out, _, _) in layout_results.items():
        for (mode, policy, split), (report, upd) in out.items():
            base_report, base_upd = ref_out[(mode, policy, "whole")]
            errs = (
                _rel(report["loss"], base_report["loss"]),
                _rel(report["grad_norm"], base_report["grad_norm"]),
                _update_rel(upd, base_upd),
            )
            worst[(lay, mode, policy, split)] = max(errs)
            assert within(report["loss"], base_report["loss"], rtol=FP32_MODEL, scale=scale), (
                lay,
                mode,
                policy,
                split,
                errs,
            )
            assert errs[1] < FP32_MODEL and errs[2] < FP32_MODEL, (lay, mode, policy, split, errs)
    print(
        "\nlargest rel error vs TP1xDP1 whole-batch, per layout:",
        {lay: f"{max(v for k, v in worst.items() if k[0] == lay):.2e}" for lay in LAYOUTS},
    )


def test_matches_independent_hf_reference(layout_results):
    out, ref, scale = layout_results[(1, 1)]
    for (mode, policy), (j_ref, upd_ref) in ref.items():
        report, upd = out[(mode, policy, "whole")]
        assert within(report["loss"], j_ref, rtol=FP32_MODEL, scale=scale), (mode, policy, report["loss"], j_ref)
        assert _update_rel(upd, upd_ref) < FP32_MODEL, (mode, policy, _update_rel(upd, upd_ref))
        norm = math.sqrt(sum(float((u**2).sum()) for u in upd_ref.values()))
        assert within(report["grad_norm"], norm, rtol=FP32_MODEL), (mode, policy, report["grad_norm"], norm)


def test_cases_are_distinguishable(layout_results):
    """The test can fail: modes and policies give different J and updates on this batch."""
    out, _, _ = layout_results[(1, 1)]
    losses = [out[(m[0], p, "whole")][0]["loss"] for m, p in CASES]
    assert len({round(x, 7) for x in losses}) == len(losses), losses
    assert out[("sample_mean", "grpo", "whole")][0]["grad_norm"] > 1e-3
