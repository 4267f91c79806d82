"""The critic's passes of the step runner (``rl_plugin.loss.value_step``) against an independent
single-process reference.

``TokenValue`` is a small value model (embedding -> tanh -> scalar head, fp64) and
``OneFileValueBackend`` the runner's backend interface around it (a plain schedule, SGD). The
reference runs the model on each sample ALONE (the input tokens that predict its response tokens:
positions prompt_len - 1 .. T - 2) and computes the clipped loss token by token from the formula,
aggregated per mode by ``tests.support.reference.objective``; its gradient comes from autograd.
Checked on random data with masked middle segments (tool turns), an empty response and a fully
masked sample, over uneven micro-batches, in all four ``--loss-aggregation`` modes: the forward-only
values, J, ``vf_clipfrac``, ``values_mean`` and the applied gradient (SGD with lr 1: the update).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rl_plugin.loss import BadBatchError, LossConfig, StepBatch, value_loss
from rl_plugin.loss.runner import StepRunner
from rl_plugin.parallel import ParallelState
from tests.support import reference as ref
from tests.support.tolerance import FP64, within

VOCAB, HIDDEN = 32, 8
CLIP = 0.2
DIVISOR = 5.0
MODES = ("sample_mean", "token_mean", "prompt_mean", "constant")


class TokenValue(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))
        self.score = nn.Parameter(torch.randn(1, HIDDEN, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.embed[ids]) @ self.score.t()).squeeze(-1)


class OneFileValueBackend:
    """The runner's backend interface for a value model (``ForwardOptions.values``)."""

    def __init__(self, cfg: LossConfig, micro_batch_size: int = 3):
        self.parallel_state = ParallelState.single()
        self.loss_device = torch.device("cpu")
        self.loss_config = cfg
        self.model = TokenValue()
        self.runner = StepRunner(self, micro_batch_size=micro_batch_size)
        self.seen_options = []

    def forward(self, model, inputs, options):
        self.seen_options.append(options)
        if not options.values:
            raise AssertionError("a value pass must ask for values")
        ids = inputs.input_ids.reshape(-1)[inputs.layout.logit_index]  # the input predicting each token
        return model(ids).unsqueeze(1)

    def schedule(self, model, num_micro_batches, forward, loss, *, forward_only):
        for i in range(num_micro_batches):
            objective = loss(i, forward(i))
            if not forward_only:
                objective.backward()
        return num_micro_batches

    def optimizer_step(self):
        params = list(self.model.parameters())
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        with torch.no_grad():
            for p in params:
                p -= p.grad  # lr 1: the update is the applied gradient
                p.grad = None
        return norm, 1.0


def make_batch(seed: int = 0) -> StepBatch:
    """8 samples in 3 groups: a masked tool turn (positions 2-3) in every response of 5+ tokens,
    random drops elsewhere, an empty response, a one-token response and a fully masked sample."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.tensor([6, 1, 5, 0, 4, 7, 2, 8])
    total = torch.randint(1, 5, (8,), generator=g) + resp
    r = int(resp.sum())
    sid = torch.repeat_interleave(torch.arange(8), resp)
    pos = torch.arange(r) - (torch.cumsum(resp, 0) - resp)[sid]
    mask = (torch.rand(r, generator=g) > 0.15).double()
    mask[(resp[sid] >= 5) & (pos >= 2) & (pos < 4)] = 0.0
    mask[sid == 4] = 0.0
    returns = torch.randn(r, generator=g, dtype=torch.float64)
    values = returns + 0.5 * torch.randn(r, generator=g, dtype=torch.float64)
    return StepBatch(
        tokens=torch.randint(0, VOCAB, (int(total.sum()),), generator=g),
        total_lengths=total,
        response_lengths=resp,
        loss_mask=mask,
        advantages=torch.zeros(r, dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]),
        values=values,
        returns=returns,
    ).validate()


def reference_values(model: TokenValue, batch: StepBatch) -> torch.Tensor:
    out, start = [], 0
    for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
        ids = batch.tokens[start : start + t]
        start += t
        out.append(model(ids[t - r - 1 : t - 1]))  # positions predicting the response tokens
    return torch.cat(out)


def reference_step(model: TokenValue, batch: StepBatch, mode: str):
    """(values, J, clipfrac, values_mean, gradients) from the per-sample forward and the formula."""
    v = reference_values(model, batch)
    lengths = batch.response_lengths.tolist()
    per_token = []
    for vp, ret, old in zip(v, batch.returns, batch.values):
        vc = old + torch.clamp(vp - old, -CLIP, CLIP)
        per_token.append(0.5 * torch.maximum((vp - ret) ** 2, (vc - ret) ** 2))
    j = ref.objective(torch.stack(per_token), batch.loss_mask, lengths, batch.group_ids, mode, DIVISOR)
    grads = torch.autograd.grad(j, list(model.parameters()))
    vd = v.detach()
    outside = (vd - batch.values).abs() > CLIP
    vc = batch.values + (vd - batch.values).clamp(-CLIP, CLIP)
    clipped = outside & ((vc - batch.returns) ** 2 > (vd - batch.returns) ** 2)
    m = batch.loss_mask
    clipfrac = float((clipped.double() * m).sum() / m.sum())
    values_mean = float((v.detach() * m).sum() / m.sum())
    return vd, float(j.detach()), clipfrac, values_mean, grads


def _cfg(mode: str) -> LossConfig:
    return LossConfig(loss_aggregation=mode, loss_aggregation_divisor=DIVISOR if mode == "constant" else None)


@pytest.mark.parametrize("mode", MODES)
def test_value_step_equals_the_single_pass_reference(mode):
    batch = make_batch()
    backend = OneFileValueBackend(_cfg(mode), micro_batch_size=3)  # micro-batches of 3, 3, 2 samples
    ref_v, ref_j, ref_clipfrac, ref_vmean, ref_grads = reference_step(TokenValue(), batch, mode)
    values = backend.runner.values(backend.model, batch)
    assert values.dtype == torch.float32 and values.device.type == "cpu"
    assert torch.allclose(values.double(), ref_v, rtol=2**-22, atol=2**-22)  # fp32 rounding of |v| < 3
    w0 = [p.detach().clone() for p in backend.model.parameters()]
    report = backend.runner.value_step(backend.model, batch, num_groups=3, value_clip=CLIP)
    assert set(report) == {"value_loss", "vf_clipfrac", "values_mean", "grad_norm", "lr", "num_micro_batches"}
    assert report["num_micro_batches"] == 3.0 and report["lr"] == 1.0
    scale = max(1.0, float(batch.returns.abs().max()) ** 2)  # the squared errors' magnitude
    assert within(report["value_loss"], ref_j, rtol=FP64, scale=scale), (report["value_loss"], ref_j)
    assert within(report["vf_clipfrac"], ref_clipfrac, rtol=FP64, scale=1.0)
    assert within(report["values_mean"], ref_vmean, rtol=FP64, scale=1.0)
    assert 0.1 < ref_clipfrac < 0.9  # both branches of the clip are exercised
    for p, p0, g in zip(backend.model.parameters(), w0, ref_grads):
        update = p0 - p.detach()
        assert float((update - g).abs().max()) <= FP64 * scale * max(1.0, float(g.abs().max())), mode
    grad_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads])))
    assert within(report["grad_norm"], grad_norm, rtol=FP64, scale=scale)
    assert all(o.values for o in backend.seen_options)


def test_value_step_matches_value_loss_on_the_padded_batch():
    """The distributed step's J is the reference API's ``value_loss`` on ``[batch, len]`` tensors."""
    batch = make_batch(seed=3)
    backend = OneFileValueBackend(_cfg("prompt_mean"), micro_batch_size=2)
    v = reference_values(TokenValue(), batch).detach()
    lengths = batch.response_lengths
    rows, width = lengths.numel(), int(lengths.max())
    cols = torch.arange(width).expand(rows, width)
    valid = cols < lengths.unsqueeze(1)

    def pad(x):
        out = torch.zeros(rows, width, dtype=x.dtype)
        out[valid] = x
        return out

    loss, clipfrac = value_loss(
        pad(v),
        pad(batch.returns),
        pad(batch.values),
        pad(batch.loss_mask),
        CLIP,
        "prompt_mean",
        group_ids=batch.group_ids,
    )
    report = backend.runner.value_step(backend.model, batch, num_groups=3, value_clip=CLIP)
    assert within(report["value_loss"], float(loss), rtol=FP64, scale=4.0)
    assert within(report["vf_clipfrac"], float(clipfrac), rtol=FP64, scale=1.0)


def test_value_clip_changes_the_loss():
    """The clip range reaches the loss: a wide clip never takes the clipped branch here."""
    batch = make_batch()
    reports = []
    for clip in (CLIP, 100.0):
        backend = OneFileValueBackend(_cfg("token_mean"))
        reports.append(backend.runner.value_step(backend.model, batch, num_groups=3, value_clip=clip))
    assert reports[1]["vf_clipfrac"] == 0.0 and reports[0]["vf_clipfrac"] > 0.1
    assert reports[0]["value_loss"] > reports[1]["value_loss"]


def test_value_step_refuses_a_batch_without_values_or_returns():
    batch = make_batch()
    batch.returns = None
    backend = OneFileValueBackend(_cfg("sample_mean"))
    with pytest.raises(BadBatchError, match="no returns"):
        backend.runner.value_step(backend.model, batch, num_groups=3)
    batch = make_batch()
    batch.values[5] = float("nan")
    with pytest.raises(BadBatchError, match=r"sample 0: values\[5\]"):
        backend.runner.value_step(backend.model, batch, num_groups=3)
    with pytest.raises(ValueError, match="--value-clip must be > 0"):
        backend.runner.value_step(backend.model, make_batch(), num_groups=3, value_clip=0.0)


def test_values_and_returns_travel_with_selections():
    batch = make_batch()
    sub = batch.select(torch.tensor([5, 0]))
    starts = torch.cumsum(batch.response_lengths, 0) - batch.response_lengths
    want = torch.cat([batch.returns[int(starts[5]) : int(starts[5]) + 7], batch.returns[:6]])
    assert torch.equal(sub.returns, want)
    assert sub.values.shape == sub.returns.shape == (13,)
