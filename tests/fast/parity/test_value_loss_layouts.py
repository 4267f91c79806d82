"""The critic's value loss and its gradient are the same on every layout (real gloo), issue 47.

**The core** (``StepRunner.value_step`` / ``values``, every DP x CP x qkv-format x micro-batch
layout): a value "model" that is two tables, V = theta[input token] + phi[position] at the input
position predicting each response token, so the runner's alignment, CP chunks and padding all
reach the numbers. On ``tests.support.critic.value_step_data`` (masked middle segments, an
all-masked sample, a zero-length response; old values around the model's own predictions, so
both branches of the clip occur), in every ``--loss-aggregation`` mode: J, the
clip fraction, the values mean, the forward-only values and the all-reduced gradient equal the
single-process reference (each sample alone, the formula, ``reference.objective``) within
``tolerance.FP64`` (fp64 tables).

**The FSDP backend** (real FSDP2, the tiny Qwen2 as a critic with a random head, fp32): DP1 with
one and with 2-sample micro-batches, DP2 with 1-sample micro-batches (rank 1 runs an idle pass),
a token budget and padded bshd rows. In every mode the report (J, clip fraction, values mean, grad
norm), the forward-only values and the update (exact SGD, lr 1: the applied gradient, under HF
names) agree across layouts within ``tolerance.FP32_MODEL``, and J, the grad norm and the values
equal the per-sample autograd reference on the unsharded HF model.

The Megatron layouts and the cross-backend comparison reuse ``tests.support.critic.value_worker``
(``backend="megatron"``) and the checks of ``check_layouts_agree``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support import critic
from tests.support import reference as ref
from tests.support.fsdp_common import VOCAB, step_batch
from tests.support.tolerance import FP32_MODEL, FP64, max_abs, tensor_within, within

CORE_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MAX_POS = 32
SEQ_LEN = 16  # bshd padded length (the longest sample has 14 tokens)


def tables():
    g = torch.Generator().manual_seed(1)
    return torch.randn(VOCAB, generator=g, dtype=torch.float64), 0.3 * torch.randn(
        MAX_POS, generator=g, dtype=torch.float64
    )


class TableValueBackend:
    """The runner's backend interface around the two tables; the optimizer step all-reduces the
    gradient (every rank's share of J) and keeps it, and applies nothing."""

    def __init__(self, cfg, ps, micro_batch_size):
        from rl_plugin.loss.runner import StepRunner

        self.parallel_state, self.loss_config, self.loss_device = ps, cfg, torch.device("cpu")
        theta, phi = tables()
        self.model = torch.nn.ParameterList([torch.nn.Parameter(theta), torch.nn.Parameter(phi)])
        self.runner = StepRunner(self, micro_batch_size=micro_batch_size)
        self.grads = None

    def forward(self, model, inputs, options):
        assert options.values
        rows = inputs.layout.logit_index
        ids, pos = inputs.input_ids.reshape(-1)[rows], inputs.position_ids.reshape(-1)[rows]
        return (model[0][ids] + model[1][pos]).unsqueeze(1)

    def schedule(self, model, num_micro_batches, forward, loss, *, forward_only):
        """As FSDP's: every DP rank runs the largest count (the runner hands the extra passes
        empty micro-batches, ``[0, 1]`` here), so the report's pass count is the same everywhere."""
        n = torch.tensor([num_micro_batches])
        if self.parallel_state.dp_group is not None:
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.parallel_state.dp_group)
        for i in range(int(n)):
            objective = loss(i, forward(i))
            if not forward_only:
                objective.backward()
        return int(n)

    def optimizer_step(self):
        self.grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        for g in self.grads:
            dist.all_reduce(g)
        return float(torch.cat(self.grads).norm()), 1.0


def table_values(batch, theta, phi):
    """V of every response token, each sample alone: the tables at the positions predicting it."""
    vs, start = [], 0
    for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
        ids = batch.tokens[start : start + t]
        start += t
        vs.append(theta[ids[t - r - 1 : t - 1]] + phi[torch.arange(t - r - 1, t - 1)])
    return torch.cat(vs)


def core_reference(data, mode):
    """(values, J, clipfrac, values_mean, [dJ/dtheta, dJ/dphi]) of the tables, sample by sample."""
    theta, phi = (t.clone().requires_grad_(True) for t in tables())
    batch = step_batch(data)
    v = table_values(batch, theta, phi)
    old, ret, m = batch.values.double(), batch.returns.double(), batch.loss_mask.double()
    vc = old + torch.clamp(v - old, -critic.VALUE_CLIP, critic.VALUE_CLIP)
    per_token = 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2)
    j = ref.objective(per_token, m, batch.response_lengths.tolist(), batch.group_ids, mode, critic.DIVISOR)
    grads = torch.autograd.grad(j, [theta, phi])
    vd = v.detach()
    hit = ((vd - old).abs() > critic.VALUE_CLIP) & ((vc.detach() - ret) ** 2 > (vd - ret) ** 2)
    return vd, float(j.detach()), float((hit.double() * m).sum() / m.sum()), float((vd * m).sum() / m.sum()), grads


def _core_worker(rank, world, dp, cp, data, combos):
    from rl_plugin.loss import LossConfig
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp
    from rl_plugin.parallel import ParallelState

    ps = ParallelState.from_world(tp=1, cp=cp, dp=dp)
    mine = split_samples_for_dp(data["total_lengths"].numel(), dp)[ps.dp_rank]
    out = {}
    for fmt, mbs, mode in combos:
        cfg = LossConfig(
            loss_aggregation=mode,
            loss_aggregation_divisor=critic.DIVISOR if mode == "constant" else None,
            qkv_format=fmt,
            max_seq_len=SEQ_LEN if fmt == "bshd" else None,
        )
        backend = TableValueBackend(cfg, ps, mbs)
        local = step_batch(data).select(mine)
        local.values, local.returns = local.values.double(), local.returns.double()
        values = backend.runner.values(backend.model, local)
        report = backend.runner.value_step(backend.model, local, num_groups=3, value_clip=critic.VALUE_CLIP)
        out[(fmt, mbs, mode)] = dict(report=report, values=values, grads=backend.grads, dp_rank=ps.dp_rank)
    return out


@pytest.fixture(scope="module")
def data():
    return critic.value_step_data(0)


@pytest.fixture(scope="module")
def core_data(data):
    """``data`` with old values near the tables' predictions (within the clip range or just past
    it) and returns further off, so both branches of the clipped loss occur."""
    return critic.around_predictions(data, table_values(step_batch(data), *tables()))


@pytest.mark.parametrize("dp,cp", CORE_LAYOUTS, ids=[f"dp{d}-cp{c}" for d, c in CORE_LAYOUTS])
def test_core_value_step_matches_reference_on_every_layout(run_world, dp, cp, core_data):
    data = core_data
    combos = [(fmt, mbs, mode) for fmt in ("thd", "bshd") for mbs in (1, 3) for mode in critic.MODES]
    per_rank = run_world(_core_worker, dp * cp, dp, cp, data, combos)
    scale = max(1.0, max_abs(data["returns"], data["values"]) ** 2)
    for fmt, mbs, mode in combos:
        where = f"dp={dp} cp={cp} {fmt} micro-batch={mbs} {mode}"
        v_ref, j_ref, clip_ref, vmean_ref, g_ref = core_reference(data, mode)
        runs = [r[(fmt, mbs, mode)] for r in per_rank]
        assert all(r["report"] == runs[0]["report"] for r in runs), where  # identical on every rank
        report = runs[0]["report"]
        assert within(report["value_loss"], j_ref, rtol=FP64, scale=scale), (where, report["value_loss"], j_ref)
        assert within(report["vf_clipfrac"], clip_ref, rtol=FP64, scale=1.0), where
        assert within(report["values_mean"], vmean_ref, rtol=FP64, scale=scale), where
        by_dp = {r["dp_rank"]: r["values"] for r in runs}  # CP ranks of one DP rank hold the same
        values = torch.cat([by_dp[d] for d in range(dp)]).double()
        assert float((values - v_ref).abs().max()) <= 2**-22 * scale, where  # fp32 result
        for got, want in zip(runs[0]["grads"], g_ref):
            assert float((got - want).abs().max()) <= FP64 * scale * max(1.0, float(want.abs().max())), where
    assert 0.1 < core_reference(data, "token_mean")[2] < 0.9  # both branches of the clip occur


# -- the FSDP backend --------------------------------------------------------------------------
FSDP_LAYOUTS = {
    1: {"dp1_mb9": ["--micro-batch-size", "9"], "dp1_mb2": ["--micro-batch-size", "2"]},
    2: {
        "dp2_mb1": ["--micro-batch-size", "1"],
        "dp2_tok24": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"],
        "dp2_mb3_bshd": ["--micro-batch-size", "3", "--qkv-format", "bshd"],
    },
}


def layout_cases(layouts):
    return {
        (mode, name): [*mflags, *lflags] for mode, mflags in critic.MODES.items() for name, lflags in layouts.items()
    }


def merge_ranks(per_rank):
    """``value_worker``'s per-rank results as one run per case: rank 0's report and update (every
    rank's report must be the same) and the values of all DP ranks in sample order."""
    merged = {}
    for case, r0 in per_rank[0].items():
        runs = [r[case] for r in per_rank]
        assert all(r["report"] == r0["report"] for r in runs), case
        by_dp = {r["dp_rank"]: r["values"] for r in runs}
        merged[case] = dict(
            report=r0["report"], update=r0["update"], values=torch.cat([by_dp[d] for d in sorted(by_dp)])
        )
    return merged


def check_layouts_agree(base, got, scale, where):
    """Two runs of the same value step (report, values, update) within ``FP32_MODEL``."""
    for key in ("value_loss", "vf_clipfrac", "values_mean", "grad_norm"):
        assert within(got["report"][key], base["report"][key], rtol=FP32_MODEL, scale=scale), (where, key)
    assert tensor_within(got["values"], base["values"], rtol=FP32_MODEL), where
    for name, d in base["update"].items():
        assert tensor_within(got["update"][name], d, rtol=FP32_MODEL), (where, name)


@pytest.fixture(scope="module")
def fsdp_runs(run_world, tiny_qwen2, tmp_path_factory, data):
    ckpt = critic.value_checkpoint(tmp_path_factory.mktemp("critic"), tiny_qwen2)
    data = critic.around_predictions(data, critic.reference_value_step(ckpt, data, "sample_mean")[2])
    merged = {}
    for world, layouts in FSDP_LAYOUTS.items():
        merged.update(merge_ranks(run_world(critic.value_worker, world, "fsdp", ckpt, data, layout_cases(layouts))))
    return ckpt, data, merged


@pytest.mark.parametrize("mode", list(critic.MODES))
def test_fsdp_value_step_is_the_same_on_every_layout_and_matches_reference(fsdp_runs, mode):
    ckpt, data, merged = fsdp_runs
    base = merged[(mode, "dp1_mb9")]
    j_ref, norm_ref, v_ref = critic.reference_value_step(ckpt, data, mode)
    scale = max(1.0, max_abs(data["returns"], data["values"]) ** 2)
    assert within(base["report"]["value_loss"], j_ref, rtol=FP32_MODEL, scale=scale), (base["report"], j_ref)
    assert within(base["report"]["grad_norm"], norm_ref, rtol=FP32_MODEL), (base["report"]["grad_norm"], norm_ref)
    assert tensor_within(base["values"], v_ref.float(), rtol=FP32_MODEL)
    assert base["report"]["grad_norm"] > 1e-2 and 0.0 < base["report"]["vf_clipfrac"] < 1.0
    assert all(float(d.abs().max()) > 0 for d in base["update"].values())  # every weight has a gradient
    for name in [n for names in FSDP_LAYOUTS.values() for n in names if n != "dp1_mb9"]:
        check_layouts_agree(base, merged[(mode, name)], scale, f"{mode} {name}")


def test_modes_differ(fsdp_runs):
    """The comparison can fail: the four modes give four different losses on this batch."""
    _, _, merged = fsdp_runs
    losses = [merged[(mode, "dp1_mb9")]["report"]["value_loss"] for mode in critic.MODES]
    assert len({round(x, 6) for x in losses}) == 4, losses
