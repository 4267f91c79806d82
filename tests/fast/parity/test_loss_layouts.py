"""J and dJ/dx are identical for every DP x CP x qkv-format x micro-batch layout (real gloo).

One step's data (uneven lengths, an empty sample, a zero-length response, one-token responses,
an all-masked prompt group, groups straddling DP ranks) is spread over DP ranks, cut into
micro-batches and zigzag CP chunks exactly as a backend does (``prepare_step`` ->
``ctx.micro_batch`` -> ``ctx.loss``). The summed contributions and the all-reduced gradient of
the global per-token input must equal the naive single-process reference of ``reference.py``
within ``tolerance.FP64`` (fp64) or ``tolerance.FP32_LOSS_CORE`` (fp32 inputs), against the
magnitude of the terms: J's per-token terms are |A| * exp(logp - old) (plus KL and entropy terms
of order 1) and the log-ratio's rounding scales with |logp|, so J is compared against
max(1, |J|, max|A|) * L and the gradient (relative to its largest element) against L, where
L = max(1, max|logp|, max|old|, max|ref|).

Off-policy kinds (``tis-<level>-<mode>``, ``tis-custom``, ``ds-scale``) run the PPO objective with
the engine's rollout log-probs differing from the old ones: TIS weights at token, sequence and
geometric level, truncated and masked, a slime-style custom TIS function over full responses
(sequence level, so it must see whole sequences under CP), and DeepSpeed's gradient scale
(reported J unchanged, gradient / N).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from rl_plugin.cp import exclusive_cumsum, expand_runs
from rl_plugin.loss import LossConfig, StepBatch, prepare_step
from rl_plugin.loss.micro_batch_plan import micro_batches_by_count, split_samples_for_dp
from rl_plugin.parallel import ParallelState
from tests.support import reference as ref
from tests.support.tolerance import FP32_LOSS_CORE, FP64, max_abs

MODES = ("sample_mean", "token_mean", "prompt_mean", "constant")
DIVISOR = 7.0
EPS, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0
KL_COEF, ENT_COEF = 0.1, 0.01
SEQ_LEN = 24  # bshd padded length
OPD_COEF = 0.7


def make_step(seed: int = 0, *, tool_turn: bool = True):
    """The global step: 14 samples in 4 prompt groups (sizes 5, 3, 3, 3), so that group 0 straddles
    DP ranks at DP=2 and DP=4 (shards of 4/3 samples) and group 1 at DP=2; ``tool_turn``: every
    response of 6+ tokens has a masked tool turn at positions 2-4 (issue 27; the loss snapshots
    keep the step they were recorded on, without it)."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.tensor([0] * 5 + [1] * 3 + [2] * 3 + [3] * 3)
    n = groups.numel()
    prompt = torch.randint(1, 7, (n,), generator=g)
    resp = torch.randint(2, 11, (n,), generator=g)
    resp[1] = 1  # one-token responses
    resp[6] = 1
    resp[9] = 0  # a zero-length response
    total = prompt + resp
    r = int(resp.sum())
    mask = (torch.rand(r, generator=g) > 0.2).double()
    sid = torch.repeat_interleave(torch.arange(n), resp)
    mask[sid == 2] = 0.0  # an empty sample (M_i = 0)
    mask[(sid >= 11)] = 0.0  # group 3 entirely masked
    pos = torch.arange(r) - (torch.cumsum(resp, 0) - resp)[sid]
    if tool_turn:
        mask[(resp[sid] >= 6) & (pos >= 2) & (pos < 5)] = 0.0  # a tool turn in the middle (issue 27)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    adv = rewards[sid]
    logp = -torch.rand(r, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(r, generator=g, dtype=torch.float64)
    refp = logp + 0.2 * torch.randn(r, generator=g, dtype=torch.float64)
    x = torch.randn(r, generator=g, dtype=torch.float64)
    ent = torch.rand(r, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(3, 50, (int(total.sum()),), generator=g)
    rollout = old + 0.3 * torch.randn(r, generator=g, dtype=torch.float64)  # the engine's log-probs
    teacher = logp + 0.4 * torch.randn(r, generator=g, dtype=torch.float64)  # an OPD teacher's (drawn last)
    return dict(
        teacher=teacher,
        groups=groups,
        total=total,
        resp=resp,
        mask=mask,
        adv=adv,
        logp=logp,
        old=old,
        ref=refp,
        x=x,
        ent=ent,
        tokens=tokens,
        rollout=rollout,
    )


# TIS bands: truncate clips on both sides of the data's ratios; mask keeps a band around 1.
TIS_BANDS = {"truncate": (0.8, 1.5), "mask": (0.5, 2.0)}
TIS_KINDS = (
    "tis-token-truncate",
    "tis-token-mask",
    "tis-sequence-truncate",
    "tis-sequence-mask",
    "tis-geometric-truncate",
    "tis-geometric-mask",
)


def tis_setting(kind):
    """(level, mode, low, high) of a ``tis-*`` kind; ``tis-custom`` is sequence-level truncation."""
    if kind == "tis-custom":
        return ("sequence", "truncate") + TIS_BANDS["truncate"]
    _, level, mode = kind.split("-")
    return (level, mode) + TIS_BANDS[mode]


def sequence_tis(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw
):
    """A slime-signature custom TIS function (user code): sequence-level truncated IS, which is
    only right if it sees whole sequences."""
    weights = [
        torch.exp(((o - r) * m.to(o.dtype)).sum()).clamp(args.tis_clip_low, args.tis_clip).expand(o.shape[0])
        for o, r, m in zip(train_log_probs, rollout_log_probs, loss_masks)
    ]
    w = torch.cat(weights) if weights else pg_loss.new_zeros(0)
    return pg_loss * w, loss_masks, {"custom_weight": w}


def reference_values(step, mode, kind):
    """(J, dJ/dinput) from the naive reference; input is x (raw) or logp (policy losses)."""
    lengths = step["resp"].tolist()
    leaf = (step["x"] if kind == "raw" else step["logp"]).clone().requires_grad_(True)
    if kind == "raw":
        j = ref.objective(leaf, step["mask"], lengths, step["groups"], mode, DIVISOR)
    elif kind == "sft":  # issue 35: the NLL under the mode, nothing else
        j = ref.objective(-leaf, step["mask"], lengths, step["groups"], mode, DIVISOR)
    else:
        if kind in ("ppo", "ds-scale"):
            tok = ref.ppo_tokens(leaf, step["old"], step["adv"], EPS, EPS_HIGH, DUAL_C)
        elif kind == "opd":  # issue 35: A - coef * m * (old - teacher), coef = OPD_COEF
            adv = step["adv"] - OPD_COEF * step["mask"] * (step["old"] - step["teacher"])
            tok = ref.ppo_tokens(leaf, step["old"], adv, EPS, EPS_HIGH, DUAL_C)
        elif kind.startswith("tis"):
            level, tis_mode, low, high = tis_setting(kind)
            w = ref.tis_weights(step["old"], step["rollout"], step["mask"], lengths, level, tis_mode, low, high)
            tok = ref.ppo_tokens(leaf, step["old"], step["adv"], EPS, EPS_HIGH, DUAL_C) * w
        else:
            tok = ref.gspo_tokens(leaf, step["old"], step["adv"], step["mask"], lengths, EPS, EPS_HIGH)
        j = ref.objective(tok, step["mask"], lengths, step["groups"], mode, DIVISOR)
        kl = ref.low_var_kl(leaf, step["ref"])
        j = j + KL_COEF * ref.objective(kl, step["mask"], lengths, step["groups"], "sample_mean")
        j = j - ENT_COEF * ref.objective(step["ent"], step["mask"], lengths, step["groups"], "sample_mean")
    j.backward()
    return float(j.detach()), leaf.grad.clone()


def custom_sample_mean(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """A miles-style reducer factory (user code): sum over samples of each sample's masked mean."""

    def reduce(x):
        pieces = x.split(list(response_lengths))
        return sum((xi * mi.to(xi.dtype)).sum() / mi.sum().clamp_min(1) for xi, mi in zip(pieces, loss_masks))

    return reduce


def _worker(rank, world, dp, cp, step, combos):
    torch.use_deterministic_algorithms(True)
    ps = ParallelState.from_world(tp=1, cp=cp, dp=dp)
    shards = split_samples_for_dp(step["total"].numel(), dp)
    mine = shards[ps.dp_rank]
    resp = step["resp"]
    resp_off = exclusive_cumsum(resp)
    results = {}
    for fmt, mbs, dtype, mode, kind in combos:
        leaf = (step["x"] if kind == "raw" else step["logp"]).to(dtype).clone().requires_grad_(True)
        my_resp = expand_runs(resp_off[mine], resp[mine])
        batch = StepBatch(
            tokens=torch.cat(
                [
                    step["tokens"][int(a) : int(a) + int(b)]
                    for a, b in zip(exclusive_cumsum(step["total"])[mine], step["total"][mine])
                ]
            )
            if mine.numel()
            else torch.zeros(0, dtype=torch.long),
            total_lengths=step["total"][mine],
            response_lengths=resp[mine],
            loss_mask=step["mask"][my_resp],
            advantages=step["adv"][my_resp],
            group_ids=step["groups"][mine],
            old_log_probs=step["old"][my_resp],
            ref_log_probs=step["ref"][my_resp],
            rollout_log_probs=step["rollout"][my_resp],
            teacher_log_probs=step["teacher"][my_resp] if kind == "opd" else None,
        )
        custom = kind == "custom"
        tis = tis_setting(kind) if kind.startswith("tis") else ("token", "truncate", 0.0, 2.0)
        cfg = LossConfig(
            loss_aggregation="sample_mean" if custom else mode,
            loss_aggregation_divisor=DIVISOR if mode == "constant" else None,
            policy_loss="gspo" if kind == "gspo" else "ppo_clip",
            eps_clip=EPS,
            eps_clip_high=EPS_HIGH,
            eps_clip_c=DUAL_C if kind in ("ppo", "custom", "ds-scale", "opd") or kind.startswith("tis") else None,
            use_kl_loss=kind not in ("raw", "sft"),
            kl_loss_coef=KL_COEF if kind not in ("raw", "sft") else 0.0,
            entropy_coef=ENT_COEF if kind not in ("raw", "sft") else 0.0,
            loss_type="sft_loss" if kind == "sft" else "policy_loss",
            is_sft=kind == "sft",
            use_opd=kind == "opd",
            opd_kl_coef=OPD_COEF,
            custom_pg_reducer=custom_sample_mean if custom else None,
            qkv_format=fmt,
            max_seq_len=SEQ_LEN if fmt == "bshd" else None,
            pg_metrics="with_entropy",
            use_tis=kind.startswith("tis"),
            tis_level=tis[0],
            tis_mode=tis[1],
            tis_clip_low=tis[2],
            tis_clip=tis[3],
            custom_tis_function=sequence_tis if kind == "tis-custom" else None,
            deepspeed_grad_scale=kind == "ds-scale",
        )
        ctx = prepare_step(batch, cfg, ps, num_groups=4)
        local_sum = leaf.new_zeros(())
        for idx in micro_batches_by_count(mine.numel(), mbs):
            mb = ctx.micro_batch(idx)
            step_resp = expand_runs(exclusive_cumsum(batch.response_lengths)[idx], batch.response_lengths[idx])
            glob = my_resp[step_resp[mb.layout.resp_index]]
            if kind == "raw":
                contrib = (leaf[glob] * mb.pg_weights.to(dtype)).sum()
            else:
                ent = step["ent"][glob].to(dtype)
                contrib = ctx.loss(leaf[glob], ent, mb).objective
            contrib.backward()
            local_sum = local_sum + contrib.detach()
        report = ctx.finish()
        j = local_sum.to(torch.float64).reshape(1)
        dist.all_reduce(j)
        grad = leaf.grad.to(torch.float64) if leaf.grad is not None else torch.zeros_like(leaf, dtype=torch.float64)
        dist.all_reduce(grad)
        results[(fmt, mbs, str(dtype), mode, kind)] = (
            float(j),
            grad,
            report["loss"] if kind != "raw" else float(j),
            report,
        )
    return results if rank == 0 else None


LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]
KINDS = ("raw", "ppo", "gspo")


@pytest.fixture(scope="module")
def step():
    return make_step()


@pytest.fixture(scope="module")
def references(step):
    out = {(mode, kind): reference_values(step, mode, kind) for mode in MODES for kind in KINDS}
    out[("sample_mean", "custom")] = reference_values(step, "sample_mean", "ppo")
    out[("sample_mean", "ds-scale")] = reference_values(step, "sample_mean", "ppo")
    for kind in TIS_KINDS + ("tis-custom", "sft", "opd"):
        for mode in MODES:
            out[(mode, kind)] = reference_values(step, mode, kind)
    return out


def tis_combos():
    """Kept small (every combo runs on every DP x CP layout): with 3-sample micro-batches, token
    truncation on every mode (and fp32), each other level x mode once on alternating modes, the
    custom function (CP gather) and DeepSpeed's scale; with 1-sample micro-batches, token
    truncation on two modes."""
    combos = []
    for i, fmt in enumerate(("thd", "bshd")):
        combos += [(fmt, 1, torch.float64, mode, "tis-token-truncate") for mode in ("sample_mean", "prompt_mean")]
        combos += [(fmt, 3, torch.float64, mode, "tis-token-truncate") for mode in MODES]
        combos += [(fmt, 3, torch.float32, "sample_mean", "tis-token-truncate")]
        combos += [
            (fmt, 3, torch.float64, ("sample_mean", "token_mean")[(i + j) % 2], k) for j, k in enumerate(TIS_KINDS[1:])
        ]
        combos += [(fmt, 3, torch.float64, ("prompt_mean", "sample_mean")[i], "tis-custom")]
        combos += [(fmt, 3, torch.float64, "sample_mean", "ds-scale")]
    return combos


@pytest.mark.parametrize("dp,cp", LAYOUTS, ids=[f"dp{d}-cp{c}" for d, c in LAYOUTS])
def test_objective_and_gradient_match_reference(run_world, dp, cp, step, references):
    combos = list(itertools.product(("thd", "bshd"), (1, 3), (torch.float64, torch.float32), MODES, KINDS))
    combos += [(fmt, 2, torch.float64, "sample_mean", "custom") for fmt in ("thd", "bshd")]
    combos += tis_combos()
    # issue 35: SFT's NLL in every mode, OPD's shifted advantages (fp64 and fp32)
    combos += [(fmt, 3, torch.float64, mode, "sft") for fmt in ("thd", "bshd") for mode in MODES]
    combos += [("thd", 1, torch.float32, "token_mean", "sft"), ("bshd", 3, torch.float32, "sample_mean", "opd")]
    combos += [(fmt, 3, torch.float64, mode, "opd") for fmt, mode in (("thd", "sample_mean"), ("bshd", "token_mean"))]
    results = run_world(_worker, dp * cp, dp, cp, step, combos)[0]
    log_scale = max(1.0, max_abs(step["logp"], step["old"], step["ref"]))  # L in the module docstring
    n = step["total"].numel()
    worst = (0.0, "")
    for (fmt, mbs, dtype, mode, kind), (j, grad, reported, report) in results.items():
        j_ref, g_ref = references[(mode, kind)]
        if kind == "ds-scale":  # DeepSpeed: backward objective J / N, reported loss J
            j, grad = j * n, grad * n
        if kind.startswith("tis"):
            level, tis_mode, low, high = tis_setting(kind)
            w = ref.tis_weights(
                step["old"], step["rollout"], step["mask"], step["resp"].tolist(), level, tis_mode, low, high
            )
            if kind != "tis-custom":
                w_mean = float(ref.objective(w, step["mask"], step["resp"].tolist(), step["groups"], "sample_mean"))
                assert abs(report["tis/weight_mean"] - w_mean) <= FP64 * log_scale, (
                    f"{kind}: tis/weight_mean {report['tis/weight_mean']} != {w_mean}"
                )
            else:
                w_mean = float(ref.objective(w, step["mask"], step["resp"].tolist(), step["groups"], "sample_mean"))
                assert abs(report["tis/custom_weight"] - w_mean) <= FP64 * log_scale, (
                    f"custom metric {report['tis/custom_weight']} != {w_mean}"
                )
            # mismatch metrics, reduced over every DP x CP rank (fp64 inputs: summation order only)
            d = (step["old"] - step["rollout"]) * step["mask"]
            lengths = step["resp"].tolist()
            for key, per_token in (("mismatch/abs_diff_mean", d.abs()), ("mismatch/k3_kl", torch.expm1(d) - d)):
                want = float(ref.objective(per_token, step["mask"], lengths, step["groups"], "sample_mean"))
                assert abs(report[key] - want) <= FP64 * log_scale, (
                    f"dp={dp} cp={cp} {kind}: {key} {report[key]} != {want}"
                )
            assert report["mismatch/abs_diff_max"] == float(d.abs()[step["mask"] > 0].max())
        rtol = FP64 if dtype == "torch.float64" else FP32_LOSS_CORE
        tol = rtol * log_scale
        scale = max(1.0, abs(j_ref), max_abs(step["adv"]))
        gscale = max(1e-3, float(g_ref.abs().max()))
        where = f"dp={dp} cp={cp} {fmt} micro-batch={mbs} {dtype} {mode} {kind}"
        assert abs(j - j_ref) <= tol * scale, f"{where}: J={j!r} reference={j_ref!r}"
        assert abs(reported - j_ref) <= tol * scale, f"{where}: reported loss {reported!r} != J {j_ref!r}"
        err = float((grad - g_ref).abs().max()) / gscale
        assert err <= tol, f"{where}: max relative grad error {err:.3e}"
        worst = max(worst, (max(abs(j - j_ref) / scale, err) / tol, where))
    # every combination is within its bound (asserted above); the closest one, for the log (-s)
    print(f"\ndp={dp} cp={cp}: largest error {worst[0]:.2f} of its tolerance ({worst[1]})")
