"""Optimizer, learning-rate schedule and gradient clipping of the FSDP backend.

- AdamW over the sharded fp32 master parameters (DTensors), hyper-parameters from Megatron-LM's
  flags (``--lr``, ``--adam-beta1/2``, ``--adam-eps``, ``--weight-decay``); ``--optimizer sgd``
  gives SGD with ``--sgd-momentum``. As in Megatron-LM, biases and 1-D parameters (norms) get no
  weight decay. ``foreach``: one multi-tensor op per update over all shards (the per-parameter
  DTensor loop was 10x slower on the tiny model).
- ``megatron_lr(step)``: Megatron's ``OptimizerParamScheduler`` learning rate (linear warm-up from
  0 over ``--lr-warmup-iters``, then ``--lr-decay-style`` down to ``--min-lr`` at
  ``--lr-decay-iters``), evaluated at the number of optimizer steps already taken, so the first
  step uses step 0's rate exactly as Megatron does.
- ``clip_grad_norm``: the global L2 norm over every DTensor gradient shard (one all-reduce), and
  Megatron's / torch's clip coefficient ``max_norm / (norm + 1e-6)`` when it is below 1.
"""

from __future__ import annotations

import math
from typing import Iterable, List

import torch
from torch import nn

from rl_plugin.configs import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, opt: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW, or SGD with ``--optimizer sgd`` (Megatron-LM's flag: momentum ``--sgd-momentum``)."""
    if opt.optimizer == "sgd":
        return torch.optim.SGD(
            param_groups(model, opt.weight_decay), lr=megatron_lr(opt, 0), momentum=opt.sgd_momentum, foreach=True
        )
    return torch.optim.AdamW(
        param_groups(model, opt.weight_decay),
        lr=megatron_lr(opt, 0),
        betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps,
        foreach=True,  # one multi-tensor op per state update over all (same-mesh, Shard(0)) DTensor shards
    )


def megatron_lr(opt: OptimizerConfig, step: int) -> float:
    """Megatron-LM's learning rate after ``step`` optimizer steps (see module docstring)."""
    max_lr, min_lr = opt.lr, opt.min_lr
    warmup = opt.lr_warmup_iters
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    style = opt.lr_decay_style
    if style == "constant":
        return max_lr
    decay = int(opt.lr_decay_iters)
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the (sharded) gradients, identical on every rank, fp32."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # partial sums of squares -> one all-reduce
    return norm.float()


def clip_grad_norm(params: List[nn.Parameter], max_norm: float) -> float:
    """Clip in place when ``max_norm > 0``; returns the pre-clip global norm."""
    norm = grad_norm(params)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return float(norm)
