"""The FSDP backend's optimizer side (``rl_plugin.backends.fsdp.optim``): the learning rate equals
megatron-core's ``OptimizerParamScheduler`` at every step for every decay style, biases and norms
get no weight decay, and clipping scales the gradients by ``max_norm / (norm + 1e-6)``. The
settings are a namespace of the ``OptimizerConfig`` fields the functions read."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rl_plugin.backends.fsdp.optim import build_optimizer, clip_grad_norm, grad_norm, megatron_lr, param_groups


def _opt(**over):
    fields = dict(
        optimizer="adam",
        lr=1e-3,
        min_lr=1e-5,
        lr_warmup_iters=3,
        lr_decay_iters=10,
        lr_decay_style="cosine",
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_eps=1e-8,
        sgd_momentum=0.9,
    )
    fields.update(over)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_lr_is_megatrons_at_every_step(style, warmup):
    opt = _opt(lr_decay_style=style, lr_warmup_iters=warmup)
    holder = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(
        holder, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=warmup, lr_decay_steps=10,
        lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=10, wd_incr_style="constant",
    )  # fmt: skip
    for step in range(14):
        sched.num_steps = step
        assert megatron_lr(opt, step) == pytest.approx(sched.get_lr({}), rel=1e-12, abs=0), (style, step)


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    model[2].weight.requires_grad_(False)  # frozen: in no group
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(4, 3)]
    assert no_decay["weight_decay"] == 0.0 and [tuple(p.shape) for p in no_decay["params"]] == [(4,), (4,), (4,)]
    adam = build_optimizer(model, _opt())
    assert isinstance(adam, torch.optim.AdamW) and adam.param_groups[0]["lr"] == 0.0  # step 0 of the warm-up
    assert adam.param_groups[0]["betas"] == (0.9, 0.98) and adam.param_groups[0]["eps"] == 1e-8
    sgd = build_optimizer(model, _opt(optimizer="sgd", lr_warmup_iters=0, lr_decay_style="constant"))
    assert (
        isinstance(sgd, torch.optim.SGD)
        and sgd.param_groups[0]["momentum"] == 0.9
        and sgd.param_groups[0]["lr"] == 1e-3
    )


def test_clip_scales_by_megatrons_coefficient():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert float(grad_norm([a, b])) == 5.0
    assert clip_grad_norm([a, b], 1.0) == 5.0  # the pre-clip norm
    coeff = 1.0 / (5.0 + 1e-6)
    assert torch.allclose(a.grad, torch.tensor([3.0 * coeff, 0.0])) and math.isclose(
        float(b.grad), 4.0 * coeff, rel_tol=1e-6
    )
    a.grad = torch.tensor([0.3, 0.0])
    b.grad = torch.tensor([0.4])
    assert clip_grad_norm([a, b], 0.0) == pytest.approx(0.5) and float(b.grad) == pytest.approx(0.4)  # 0: no clipping
    assert float(grad_norm([torch.nn.Parameter(torch.zeros(1))])) == 0.0  # no gradient at all
