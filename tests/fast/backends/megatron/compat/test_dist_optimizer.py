"""The distributed optimizer's repairs (``rl_plugin.backends.megatron.compat.dist_optimizer``), each
on the smallest object that has the shape megatron-core 0.16.1 gives it (a wrapper around a real
torch optimizer; the buffers' bucket layout): SGD's missing state init and the zero state before
the first step, the bucket-aligned save, and the load that gives every parameter its own ``step``.
(The real ``DistributedOptimizer`` end to end: ``test_checkpoint.py`` and ``test_reshard*.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rl_plugin.backends.megatron.compat.dist_optimizer import (
    allocate_state,
    bucket_aligned_world_state,
    init_sgd_state,
    load_optimizer,
    optimizers,
)


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]


def _step(opt, params, scale):
    for p in params:
        p.grad = torch.full_like(p, scale) * torch.arange(p.numel(), dtype=p.dtype).view_as(p)
    opt.step()


def test_optimizers_of_a_chain_or_one():
    a, b = object(), object()
    assert optimizers(SimpleNamespace(chained_optimizers=[a, b])) == [a, b]
    assert optimizers(a) == [a]


def test_zero_momentum_buffers_make_the_same_sgd_steps_as_torchs_lazy_ones():
    lazy_params, init_params = _params(), _params()
    lazy = torch.optim.SGD(lazy_params, lr=0.1, momentum=0.9)
    inited = torch.optim.SGD(init_params, lr=0.1, momentum=0.9)
    init_sgd_state(inited)
    assert all(torch.equal(inited.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in init_params)
    for scale in (1.0, -0.5, 2.0):
        _step(lazy, lazy_params, scale)
        _step(inited, init_params, scale)
    assert all(torch.equal(a, b) for a, b in zip(lazy_params, init_params))
    plain = torch.optim.SGD(_params(), lr=0.1)  # no momentum: no state to allocate
    init_sgd_state(plain)
    assert not plain.state


def test_state_before_the_first_step_is_allocated_with_step_zero():
    params = _params()
    sgd = SimpleNamespace(
        optimizer=torch.optim.SGD(params, lr=0.1, momentum=0.9),
        init_state_fn=None,
        config=None,
        get_parameter_state_dp_zero=lambda: None,  # a DistributedOptimizer
    )
    allocate_state(sgd)
    assert sgd.init_state_fn is init_sgd_state  # megatron-core sets none for SGD
    state = sgd.optimizer.state
    assert [float(state[p]["step"]) for p in params] == [0.0, 0.0]
    assert torch.equal(state[params[1]]["momentum_buffer"], torch.zeros(2, 2))
    state[params[0]]["momentum_buffer"].fill_(7.0)
    allocate_state(sgd)  # state present: left as it is
    assert float(state[params[0]]["momentum_buffer"][0]) == 7.0
    plain = SimpleNamespace(optimizer=torch.optim.SGD(_params(), lr=0.1, momentum=0.9), init_state_fn=None)
    allocate_state(plain)  # not a distributed optimizer: only the init function is set
    assert plain.init_state_fn is init_sgd_state and not plain.optimizer.state


def test_the_save_puts_each_buckets_values_back_at_its_offset():
    """Two buckets of 3 and 2 values; the first padded to 4, so the second starts at offset 4."""
    packed = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # megatron's layout: buckets back to back
    buffer = SimpleNamespace(
        numel=6, buckets=[SimpleNamespace(offset=0, numel_unpadded=3), SimpleNamespace(offset=4, numel_unpadded=2)]
    )
    calls = []

    def state_dp_zero(*args, **kwargs):
        calls.append((args, kwargs))
        return {0: {(torch.float32, torch.float32): {"param": packed.clone(), "exp_avg": 2 * packed, "other": 9}}}

    opt = SimpleNamespace(get_parameter_state_dp_zero=state_dp_zero, buffers=[buffer])
    bucket_aligned_world_state(opt)
    bucket_aligned_world_state(opt)  # once only
    world = opt.get_parameter_state_dp_zero(1, key="x")[0][(torch.float32, torch.float32)]
    assert calls == [((1,), {"key": "x"})]
    assert world["param"].tolist() == [1.0, 2.0, 3.0, 0.0, 4.0, 5.0]
    assert world["exp_avg"].tolist() == [2.0, 4.0, 6.0, 0.0, 8.0, 10.0]
    assert world["other"] == 9 and "exp_avg_sq" not in world
    none = SimpleNamespace(get_parameter_state_dp_zero=lambda: None, buffers=[buffer])  # a rank that gets nothing
    bucket_aligned_world_state(none)
    assert none.get_parameter_state_dp_zero() is None


class _DistOptimizer:
    """megatron-core's two load steps on a real torch Adam: ``load_state_dict`` gives every
    parameter the SAME step tensor (l. 820), the fully-reshardable load refuses a ``step`` key."""

    def __init__(self, params):
        self.optimizer = torch.optim.Adam(params, lr=0.1)
        self.param_state_loaded = None

    def get_parameter_state_dp_zero(self):
        return None

    def load_state_dict(self, state):
        shared = torch.tensor(float(state["step"]))
        for p in self.optimizer.param_groups[0]["params"]:
            self.optimizer.state[p] = {
                "step": shared,
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    def load_parameter_state_from_fully_reshardable(self, param_state):
        for s in self.optimizer.state.values():
            if "step" in s:
                raise KeyError("step")
            s["exp_avg"].fill_(param_state["exp_avg"])
        self.param_state_loaded = param_state


def test_the_load_gives_every_parameter_its_own_step():
    params = _params()
    opt = _DistOptimizer(params)
    load_optimizer(opt, {"step": 5, "param_state": {"exp_avg": 0.25}})
    steps = [opt.optimizer.state[p]["step"] for p in params]
    assert [float(s) for s in steps] == [5.0, 5.0] and steps[0] is not steps[1]
    assert opt.param_state_loaded == {"exp_avg": 0.25}
    assert all(float(opt.optimizer.state[p]["exp_avg"].flatten()[0]) == 0.25 for p in params)
    _step(opt.optimizer, params, 1.0)  # torch Adam increments each parameter's own step once
    assert [float(opt.optimizer.state[p]["step"]) for p in params] == [6.0, 6.0]
