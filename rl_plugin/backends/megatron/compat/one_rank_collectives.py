"""megatron-core's per-step all-reduces skipped where the group is a single rank (bitwise equal).

megatron-core 0.16.1 ``optimizer/clip_grads.py`` all-reduces the gradient norm (``get_grad_norm_fp32``,
l. 93-131: SUM of ``norm ** 2``, or MAX for the inf-norm) and the zero count (``count_zeros_fp32``)
over the model-parallel group (TP x PP) on every optimizer step, also when that group has one rank.
Under gloo that is a round trip through gloo's worker thread, ~0.7 ms a step on the embedded run
(``benchmarks/step_phases.py``), for nothing: an all-reduce SUM, MAX or MIN over one rank leaves
its tensor exactly as it is.
Installed only without CUDA (``setup.build_optimizer``), like the CPU shim: over NCCL a
one-rank all-reduce costs microseconds, and megatron-core stays untouched on GPU machines.

The same holds for the DDP gradient all-reduce (``distributed/param_and_grad_buffer.py``
``start_grad_sync``, l. 433-457) at data-parallel size 1: a SUM over one rank inside a
``_coalescing_manager`` block, which gloo still runs and waits for (~0.5 ms a step).

``install()`` gives those modules a ``torch`` whose ``distributed.all_reduce`` returns at once for
exactly that case (a synchronous SUM / MAX / MIN over a one-rank group, outside any coalescing
block) and calls the real collective otherwise; everything else is the module's ``torch`` as it
was (the CPU shim's proxy on a CPU). ``param_and_grad_buffer``'s ``_coalescing_manager`` becomes
``coalescing_manager``: for a synchronous block over a one-rank group it coalesces nothing (the
block's collectives run, or are skipped, one by one, each synchronous, so nothing is left to wait
for); any other block is torch's. Idempotent.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch.distributed as dist

MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.distributed.param_and_grad_buffer")
COALESCING_MODULES = ("megatron.core.distributed.param_and_grad_buffer",)
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


class _Nothing:
    """The handle of a block that coalesced nothing: every op in it ran synchronously."""

    def append(self, work) -> None:
        pass

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def coalescing_manager(group=None, device=None, async_ops=False):
    """``torch.distributed._coalescing_manager``, except that a synchronous block over a one-rank
    group coalesces nothing (module docstring)."""
    if async_ops or dist.get_world_size(group) != 1:
        with dist.distributed_c10d._coalescing_manager(group, device, async_ops) as cm:
            yield cm
        return
    yield _Nothing()


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
    for name in COALESCING_MODULES:
        importlib.import_module(name)._coalescing_manager = coalescing_manager
