"""megatron-core's grad-norm all-reduces skipped where the group is a single rank (bitwise equal).

megatron-core 0.16.1 ``optimizer/clip_grads.py`` all-reduces the gradient norm (``get_grad_norm_fp32``,
l. 93-131: SUM of ``norm ** 2``, or MAX for the inf-norm) and the zero count (``count_zeros_fp32``)
over the model-parallel group (TP x PP) on every optimizer step, also when that group has one rank.
Under gloo that is a round trip through gloo's worker thread, ~0.7 ms a step on the embedded run
(``benchmarks/step_phases.py``), for nothing: an all-reduce SUM, MAX or MIN over one rank leaves
its tensor exactly as it is.

``install()`` gives ``clip_grads`` a ``torch`` whose ``distributed.all_reduce`` returns at once for
exactly that case (a synchronous SUM / MAX / MIN over a one-rank group, outside any coalescing
block) and calls the real collective otherwise; everything else is the module's ``torch`` as it
was (the CPU shim's proxy on a CPU). Idempotent.
"""

from __future__ import annotations

import importlib
import types

import torch.distributed as dist

MODULES = ("megatron.core.optimizer.clip_grads",)
IDENTITY_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def is_identity_all_reduce(op, group, async_op: bool) -> bool:
    """Whether ``all_reduce(t, op, group)`` leaves ``t`` unchanged and may be skipped: a synchronous
    SUM / MAX / MIN over a one-rank group that no ``_coalescing_manager`` block is collecting."""
    if async_op or op not in IDENTITY_OPS or dist.get_world_size(group) != 1:
        return False
    c10d = dist.distributed_c10d
    coalescing = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if coalescing is None:  # unknown torch internals: do not skip
        return False
    return (group if group is not None else c10d._get_default_group()) not in coalescing


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``torch.distributed.all_reduce`` that returns at once where ``is_identity_all_reduce``."""
    if is_identity_all_reduce(op, group, async_op):
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


class _Distributed(types.ModuleType):
    def __init__(self):
        super().__init__("torch.distributed")

    def __getattr__(self, name):
        return all_reduce if name == "all_reduce" else getattr(dist, name)


class _Torch(types.ModuleType):
    """A module's ``torch`` with ``distributed`` replaced; all else forwards to what it was."""

    def __init__(self, wrapped):
        super().__init__("torch")
        self.wrapped = wrapped
        self.distributed = _Distributed()

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def install() -> None:
    """Route ``MODULES``' ``torch.distributed.all_reduce`` through ``all_reduce`` (idempotent)."""
    for name in MODULES:
        mod = importlib.import_module(name)
        if not isinstance(mod.torch, _Torch):
            mod.torch = _Torch(mod.torch)
