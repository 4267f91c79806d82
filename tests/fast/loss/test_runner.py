"""The core's step runner (``rl_plugin.loss.runner``) with a third backend written in one file.

``TokenLM`` is a real (if attention-free) language model, embedding -> linear head, and
``OneFileBackend`` implements the runner's whole backend interface around it: forward, a plain
schedule, an SGD optimizer step, a declared loss device. Two things are checked:

- the numbers (fp64): the runner's J, forward-only log-probs and gradient over several
  micro-batches (uneven sizes, an empty and a fully masked sample) equal the reference API's
  single-pass computation on the whole batch (``log_probs_and_entropy``, ``ppo_clip_loss`` /
  ``gspo_loss``, ``aggregate``). fp64 throughout: ``tolerance.FP64`` relative to the magnitude of
  the terms (log-probs ~ log V ~ 3.5 times advantages ~ 1).
- the device contract, on the ``meta`` device (no GPU here): with the backend declaring
  ``loss_device = meta``, every per-token step tensor the loss sees lives on meta, each floating
  per-token field is copied to the device once, before the first micro-batch, and during the
  micro-batches only integer index / input tensors cross to the device; nothing comes back to the
  CPU. (``finish`` copies the metric vectors to the CPU once, which meta cannot do, so the meta
  run stops after the schedule; the CPU run covers ``finish``.)
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rl_plugin.loss import LossConfig, StepBatch, aggregate, get_policy_loss, log_probs_and_entropy
from rl_plugin.loss.runner import StepRunner
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, within

VOCAB, HIDDEN = 32, 8


class TokenLM(nn.Module):
    def __init__(self, dtype=torch.float64, device="cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype).to(device))
        self.head = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype).to(device) / HIDDEN**0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.embed[ids]) @ self.head.t()


class OneFileBackend:
    """The runner's backend interface (``rl_plugin.loss.runner.StepBackend``) in one class."""

    def __init__(self, cfg: LossConfig, device="cpu", micro_batch_size: int = 2):
        self.parallel_state = ParallelState.single()
        self.loss_device = torch.device(device)
        self.loss_config = cfg
        self.model = TokenLM(device=device)
        self.runner = StepRunner(self, micro_batch_size=micro_batch_size)
        self.lr = 0.5

    def forward(self, model, inputs, options):
        if inputs.layout.num_samples == 0:
            return torch.zeros(
                (0, 2), dtype=torch.float64, device=self.loss_device, requires_grad=torch.is_grad_enabled()
            )
        rows = model(inputs.input_ids.to(self.loss_device))[inputs.layout.logit_index.to(self.loss_device)]
        logp, ent = log_probs_and_entropy(
            rows,
            inputs.targets.to(self.loss_device),
            temperature=options.temperature,
            chunk_size=options.chunk_size,
            with_entropy=options.with_entropy,
        )
        return torch.stack([logp, ent], 1)

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
                p -= self.lr * p.grad
                p.grad = None
        return norm, self.lr


def _batch(seed: int = 0) -> StepBatch:
    """7 samples in 3 groups: uneven lengths, a one-token, an empty and a fully masked response."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.tensor([3, 1, 5, 0, 4, 2, 6])
    prompt = torch.randint(1, 5, (7,), generator=g)
    total = prompt + resp
    r = int(resp.sum())
    mask = (torch.rand(r, generator=g) > 0.2).double()
    mask[9:13] = 0.0  # sample 4 fully masked
    sid = torch.repeat_interleave(torch.arange(7), resp)
    lp = -3.5 + 0.3 * torch.randn(r, generator=g, dtype=torch.float64)
    return StepBatch(
        tokens=torch.randint(0, VOCAB, (int(total.sum()),), generator=g),
        total_lengths=total,
        response_lengths=resp,
        loss_mask=mask,
        advantages=torch.randn(7, generator=g, dtype=torch.float64)[sid],
        group_ids=torch.tensor([0, 0, 1, 1, 1, 2, 2]),
        old_log_probs=lp,
        rollout_log_probs=lp + 0.05 * torch.randn(r, generator=g, dtype=torch.float64),
    ).validate()


def _reference(model: TokenLM, batch: StepBatch, cfg: LossConfig):
    """Log-probs, J and the gradient in one pass over the whole batch, with the reference API."""
    from rl_plugin.loss import MicroBatchInputs

    inputs = MicroBatchInputs.build(batch)
    rows = model(inputs.input_ids)[inputs.layout.logit_index]
    logp, _ = log_probs_and_entropy(rows, inputs.targets, with_entropy=False)
    policy = get_policy_loss(cfg.policy_loss)
    pg, _ = policy(
        logp,
        batch.old_log_probs,
        batch.advantages,
        loss_mask=batch.loss_mask,
        response_lengths=batch.response_lengths,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        eps_clip_c=cfg.eps_clip_c,
    )
    j = aggregate(pg, batch.loss_mask, batch.response_lengths, cfg.loss_aggregation, group_ids=batch.group_ids)
    grads = torch.autograd.grad(j, list(model.parameters()))
    return logp.detach(), float(j), grads


@pytest.mark.parametrize("policy,mode", [("ppo_clip", "sample_mean"), ("gspo", "prompt_mean")])
def test_runner_step_equals_the_single_pass_reference(policy, mode):
    cfg = LossConfig(policy_loss=policy, loss_aggregation=mode, eps_clip=0.1)
    backend = OneFileBackend(cfg, micro_batch_size=3)  # micro-batches of 3, 3, 1 samples
    batch = _batch()
    ref_model = TokenLM()
    ref_logp, ref_j, ref_grads = _reference(ref_model, batch, cfg)
    logp = backend.runner.log_probs(backend.model, batch)
    assert logp.dtype == torch.float32 and logp.device.type == "cpu"
    assert torch.allclose(logp.double(), ref_logp, rtol=0, atol=2**-20 * 8)  # fp32 rounding of values ~ -3.5
    w0 = [p.detach().clone() for p in backend.model.parameters()]
    report = backend.runner.train_step(backend.model, batch, num_groups=3)
    assert report["num_micro_batches"] == 3.0 and report["lr"] == backend.lr
    scale = float(batch.advantages.abs().max()) * float(ref_logp.abs().max())  # the terms that cancel
    assert within(report["loss"], ref_j, rtol=FP64, scale=scale), (report["loss"], ref_j)
    for p, p0, g in zip(backend.model.parameters(), w0, ref_grads):
        step = (p0 - p.detach()) / backend.lr  # SGD: the applied gradient
        assert float((step - g).abs().max()) <= FP64 * scale * max(1.0, float(g.abs().max())), policy
    assert report["mismatch/abs_diff_max"] is not None and report["samples"] == 7.0


class _CopyLog(TorchDispatchMode):
    """Every tensor copy between devices: (phase, source device, target device, dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.phase, self.copies = "prepare", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            dst = out
            if isinstance(src, torch.Tensor) and src.device != dst.device:
                self.copies.append((self.phase, src.device.type, dst.device.type, src.dtype, src.numel()))
        return out


class _Stop(Exception):
    pass


class _MetaBackend(OneFileBackend):
    def __init__(self, cfg, log: _CopyLog):
        super().__init__(cfg, device="meta", micro_batch_size=2)
        self.log, self.seen = log, []

    def schedule(self, model, num_micro_batches, forward, loss, *, forward_only):
        self.log.phase = "micro-batches"

        def checked_loss(i, out):
            objective = loss(i, out)
            self.seen.append(objective.device.type)
            return objective

        return super().schedule(model, num_micro_batches, forward, checked_loss, forward_only=forward_only)

    def forward(self, model, inputs, options):
        """Log-softmax in plain torch ops: the core kernel checks the targets against the vocab
        with one host read per micro-batch, which meta tensors cannot answer."""
        if inputs.layout.num_samples == 0:
            return super().forward(model, inputs, options)
        rows = model(inputs.input_ids.to(self.loss_device))[inputs.layout.logit_index.to(self.loss_device)]
        logp_all = torch.log_softmax(rows / options.temperature, -1)
        logp = logp_all.gather(1, inputs.targets.to(self.loss_device).view(-1, 1)).squeeze(1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return torch.stack([logp, ent], 1)

    def optimizer_step(self):
        raise _Stop  # the schedule ran; finish() would copy the metric vectors to the CPU (not from meta)


@pytest.mark.parametrize("policy", ["ppo_clip", "gspo"])
def test_runner_honours_the_declared_loss_device(policy):
    cfg = LossConfig(policy_loss=policy, use_tis=True, pg_metrics="with_entropy")
    log = _CopyLog()
    backend = _MetaBackend(cfg, log)
    batch = _batch()
    n_tok = int(batch.response_lengths.sum())
    with log, pytest.raises(_Stop):
        backend.runner.train_step(backend.model, batch, num_groups=3)
    assert backend.seen == ["meta"] * 4  # every micro-batch's objective on the declared device
    assert not [c for c in log.copies if c[2] == "cpu"], "nothing comes back to the CPU during the step"
    per_step = [c for c in log.copies if c[0] == "prepare"]
    per_mb = [c for c in log.copies if c[0] == "micro-batches"]
    floats_once = [c for c in per_step if c[3].is_floating_point and c[4] == n_tok]
    # loss_mask, advantages, old, rollout log-probs, the two weight vectors: once each, before the loop
    assert len(floats_once) == 6, per_step
    assert per_mb and all(not c[3].is_floating_point for c in per_mb), per_mb  # only indices and input ids
