"""Cross-backend parity: the FSDP2 and the Megatron backends train the same step.

Same tiny HF checkpoint, same global batch, DP=2 on both (real gloo, fp32, rollout temperature
0.9). For every --loss-aggregation mode x {PPO clip, GSPO}, PPO dual clip with the KL
(reference pass) and entropy terms, and TIS (token truncate, sequence mask, geometric with GSPO)
against engine log-probs that differ from the old ones, with masked tool turns in the middle of the
responses (issue 27; each step's ``tokens`` is the mask's sum): the per-token log-probs of the forward-only
pass, the step-1 loss J, the grad norm and the weight update agree within ``tolerance.FP32_MODEL``
(fp32 rounding; scalars that cancel, J and the loss terms, against the magnitude of the log-probs
and advantages). With plain SGD (lr 1, no
momentum, no clipping) the update IS the applied gradient, so this compares dJ/dtheta of the two
backends tensor by tensor under HF names. Each case starts from the same state (both backends
reload their own checkpoint of step 0).
"""

from __future__ import annotations

import importlib.util
import math
import tempfile

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, max_abs, within

MEGATRON_READY = importlib.util.find_spec("rl_plugin.backends.megatron.backend") is not None
pytestmark = pytest.mark.skipif(
    not MEGATRON_READY, reason="rl_plugin.backends.megatron.backend (MegatronBackend) is not importable"
)

BASE = [
    *EXACT_SGD,
    "--rollout-temperature",
    "0.9",
    "--eps-clip",
    "0.2",
    "--n-samples-per-prompt",
    "4",
]
MODES = {
    "sample_mean": [],
    "token_mean": ["--loss-aggregation", "token_mean"],
    "prompt_mean": ["--loss-aggregation", "prompt_mean"],
    "constant": ["--loss-aggregation", "constant", "--loss-aggregation-divisor", "8"],
}
CASES = {f"{m}/{p}": [*flags, "--advantage-estimator", p] for m, flags in MODES.items() for p in ("grpo", "gspo")}
CASES["sample_mean/dual_clip+kl+entropy"] = [
    "--eps-clip-high",
    "0.28",
    "--eps-clip-c",
    "3",
    "--use-kl-loss",
    "--kl-loss-coef",
    "0.1",
    "--entropy-coef",
    "0.01",
]
# Off-policy correction: the engine's log-probs differ from the old ones by seeded noise (0.25).
CASES["token_mean/tis_token_truncate"] = [
    "--loss-aggregation",
    "token_mean",
    "--use-tis",
    "--tis-clip",
    "1.3",
    "--tis-clip-low",
    "0.8",
]
CASES["sample_mean/tis_sequence_mask"] = [
    "--use-tis",
    "--tis-level",
    "sequence",
    "--tis-mode",
    "mask",
    "--tis-clip-low",
    "0.5",
    "--tis-clip",
    "2",
]
CASES["prompt_mean/gspo+tis_geometric"] = [
    "--loss-aggregation",
    "prompt_mean",
    "--advantage-estimator",
    "gspo",
    "--use-tis",
    "--tis-level",
    "geometric",
    "--tis-clip-low",
    "0.9",
    "--tis-clip",
    "1.05",
]
CASES["sample_mean/deepspeed_grad_scale"] = ["--advantage-estimator", "grpo", "--deepspeed-grad-scale"]
TOL = FP32_MODEL  # relative errors of tensors and of quantities that do not cancel (grad norm)
PAD_ID = 0  # the tiny models' pad_token_id


def _worker(rank, world, hf_dir):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.loss import LossConfig
    from rl_plugin.loss.micro_batch_plan import plan_micro_batches
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    base = ["--hf-checkpoint", hf_dir, *BASE]
    backends = {
        "megatron": MegatronBackend.from_args(make_args(*base, world_size=world)),
        "fsdp": FSDPBackend.from_args(make_args("--train-backend", "fsdp", *base, world_size=world)),
    }
    ps = backends["fsdp"].parallel_state
    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    batch.tokens[::5] = PAD_ID  # the pad id as a real token: both backends must train its embedding row
    # a tool turn in the middle of every response of 4+ tokens (a custom generate hook's masked ids,
    # issue 27): positions 1 and 2 are in the forward, in no loss term and in no count
    pos = torch.arange(int(batch.response_lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(batch.response_lengths, 0) - batch.response_lengths, batch.response_lengths
    )
    long_enough = torch.repeat_interleave(batch.response_lengths >= 4, batch.response_lengths)
    tool = long_enough & (pos >= 1) & (pos < 3)
    batch.loss_mask[tool] = 0.0
    local0 = dp_shard(batch, ps.dp_size, ps.dp_rank)
    plan = plan_micro_batches(local0, micro_batch_size=1, max_tokens_per_gpu=24, dp_group=ps.dp_group)
    root = [tempfile.mkdtemp(prefix="xbackend_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(root, src=0)
    w0 = {}
    for name, backend in backends.items():
        w0[name] = backend.export_hf_state_dict()
        backend.save_checkpoint(f"{root[0]}/{name}", step=0)
    old = backends["fsdp"].compute_log_probs(local0, micro_batches=plan)  # one shared old policy
    local = with_old_log_probs(local0, old)
    noise = 0.25 * torch.randn(local.old_log_probs.shape[0], generator=torch.Generator().manual_seed(rank))
    local.rollout_log_probs = local.old_log_probs + noise  # the engine's log-probs (both backends see them)
    out = {}
    for case, flags in CASES.items():
        cfg = LossConfig.from_args(make_args(*base, *flags, world_size=world))
        res = {}
        for name, backend in backends.items():
            backend.load_checkpoint(f"{root[0]}/{name}")
            backend.loss_config = cfg
            step_batch = local
            if cfg.use_kl_loss:
                from dataclasses import replace

                step_batch = replace(
                    local, ref_log_probs=backend.compute_log_probs(local, role="ref", micro_batches=plan)
                )
            logp = backend.compute_log_probs(step_batch, micro_batches=plan)
            report = backend.train_step(step_batch, num_groups=num_groups, micro_batches=plan)
            w1 = backend.export_hf_state_dict()
            res[name] = dict(report=report, logp=logp, update={k: w1[k] - w0[name][k] for k in w0[name]})
        out[case] = res
    scale = max_abs(local.old_log_probs, local.advantages, *(r["logp"] for c in out.values() for r in c.values()))
    return dict(
        out=out,
        mask_sum=float(batch.loss_mask.sum()),
        tool_tokens=int(tool.sum()),
        scale=scale,
        keys={n: sorted(w) for n, w in w0.items()},
        w0_diff=max(float((w0["fsdp"][k] - w0["megatron"][k]).abs().max()) for k in w0["fsdp"]),
    )


def _rel(a, b):
    return abs(float(a) - float(b)) / max(abs(float(b)), 1e-12)


def _tensor_rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _update_rel(da, db):
    num = math.sqrt(sum(float(((da[k] - db[k]).double() ** 2).sum()) for k in db))
    den = math.sqrt(sum(float((db[k].double() ** 2).sum()) for k in db))
    return num / den


@pytest.fixture(scope="module")
def results(run_world, tiny_qwen2):
    return run_world(_worker, 2, tiny_qwen2)


def test_same_weights_under_the_same_names(results):
    for r in results:
        assert r["keys"]["fsdp"] == r["keys"]["megatron"]
        assert r["w0_diff"] == 0.0  # both load the checkpoint exactly


@pytest.mark.parametrize("case", list(CASES))
def test_backends_agree(results, case):
    errs = {}
    for r in results:
        m, f = r["out"][case]["megatron"], r["out"][case]["fsdp"]
        # J and the loss terms are sums of per-token terms of magnitude <= scale (log-probs, advantages)
        assert within(f["report"]["loss"], m["report"]["loss"], rtol=FP32_MODEL, scale=r["scale"]), case
        e = dict(
            logp=_tensor_rel(f["logp"], m["logp"]),
            loss=_rel(f["report"]["loss"], m["report"]["loss"]),
            grad_norm=_rel(f["report"]["grad_norm"], m["report"]["grad_norm"]),
            update=_update_rel(f["update"], m["update"]),
        )
        for key in (
            "pg_loss",
            "kl_loss",
            "entropy_loss",
            "pg_clipfrac",
            "ratio_mean",
            "tis/weight_mean",
            "mismatch/k3_kl",
        ):
            if key in m["report"]:
                assert within(f["report"][key], m["report"][key], rtol=FP32_MODEL, scale=r["scale"]), (case, key)
        errs = {k: max(v, errs.get(k, 0.0)) for k, v in e.items()}
        assert m["report"]["grad_norm"] > 1e-3
    print(f"\n{case}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for key, err in errs.items():
        if key != "loss":  # checked above against the scale of its terms
            assert err < TOL, (case, key, err)


def test_step_tokens_are_the_loss_mask_sum(results):
    """Masked tokens (the tool turns above among them) are out of the step's count on both backends."""
    r = results[0]
    assert r["tool_tokens"] >= 6
    for case, res in r["out"].items():
        for name, run in res.items():
            assert run["report"]["tokens"] == r["mask_sum"], (case, name)


def test_pad_token_embedding_row_is_trained(results):
    for case in ("sample_mean/grpo", "token_mean/gspo"):
        m, f = (results[0]["out"][case][n]["update"]["model.embed_tokens.weight"][PAD_ID] for n in ("megatron", "fsdp"))
        assert float(m.abs().max()) > 1e-4
        assert _tensor_rel(f, m) < TOL, case


def test_deepspeed_grad_scale_keeps_the_loss_and_divides_the_gradient_by_n(results):
    """--deepspeed-grad-scale on sample_mean: the reported loss is the same J, the gradient (grad
    norm and, under SGD lr 1, the update) is dJ/dtheta / N, N = 12 documents in the step."""
    n = 12
    for name in ("fsdp", "megatron"):
        plain, ds = (results[0]["out"][c][name] for c in ("sample_mean/grpo", "sample_mean/deepspeed_grad_scale"))
        assert ds["report"]["loss"] == plain["report"]["loss"], name  # same code path up to the scale
        assert _rel(ds["report"]["grad_norm"] * n, plain["report"]["grad_norm"]) < TOL, name
        assert _update_rel({k: v * n for k, v in ds["update"].items()}, plain["update"]) < TOL, name


def test_cases_differ(results):
    """The comparison can fail: the cases give different objectives on this batch."""
    losses = [results[0]["out"][c]["fsdp"]["report"]["loss"] for c in CASES if "deepspeed" not in c]
    assert len({round(x, 7) for x in losses}) == len(losses), losses
