"""megatron-core 0.16.1's distributed optimizer state, repaired for rl_plugin's save and load
(``backends/megatron/checkpoint.py`` calls these; without Apex / transformer-engine the optimizer
is torch's Adam or SGD, whose state has a ``step``).

- ``allocate_state``: a save (or load) before the first step. A fresh ``DistributedOptimizer``
  has no Adam state and its ``state_dict()`` asserts on the missing ``step`` (megatron-core 0.16.1
  ``distrib_optimizer.py`` l. 640); SGD has no ``init_state_fn`` at all (``optimizer/__init__.py``
  l. 408) although ``sharded_state_dict(is_loading=True)`` calls it (``optimizer.py`` l. 1019).
- ``bucket_aligned_world_state``: the fully-reshardable save of a buffer with several buckets
  reads every parameter after a padded bucket shifted (megatron-core's own TODO,
  ``distrib_optimizer.py`` l. 1508, its issue #504).
- ``load_optimizer``: one ``step`` tensor shared by every parameter of a group after a load
  (l. 820), and the ``step`` key the fully-reshardable load copies from a checkpoint that keeps
  it in the param groups (l. 940: KeyError 'step').

Probes: ``tests/fast/backends/megatron/test_checkpoint.py`` (a resumed run continues the same
trajectory bitwise, so Adam's bias correction and moments round-trip) and
``test_reshard*.py`` (a checkpoint resharded across TP / DP / PP loads the same values). Delete a
repair when megatron-core fixes it and those tests still pass without it.
"""

from __future__ import annotations

import torch


def optimizers(optimizer):
    """The optimizers of a ``ChainedOptimizer`` (dense and expert parameters), or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def init_sgd_state(opt, config=None) -> None:
    """megatron-core 0.16.1 sets no ``init_state_fn`` for SGD (optimizer/__init__.py l. 408) yet
    ``sharded_state_dict(is_loading=True)`` calls it (optimizer.py l. 1019). Momentum buffers as
    zeros: with dampening 0, torch SGD's first step then makes buf = grad, as its lazy clone
    would, and a load has a tensor to fill (without one, the saved momentum would be skipped)."""
    for group in opt.param_groups:
        if group.get("momentum", 0):
            for p in group["params"]:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))


def allocate_state(optimizer) -> None:
    """Optimizer state tensors for a save or load before the first step.

    A fresh DistributedOptimizer has no Adam state yet, and without Apex/TE its ``state_dict()``
    (called by ``sharded_state_dict``) asserts on the missing ``step`` (megatron-core 0.16.1
    distrib_optimizer.py l. 640). Allocate zeros and step 0: exactly what torch Adam's first step
    would create, so the math is unchanged; a load overwrites them."""
    for opt in optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if opt.init_state_fn is None:
            opt.init_state_fn = init_sgd_state
        if hasattr(opt, "get_parameter_state_dp_zero") and not inner.state:
            opt.init_state_fn(inner, opt.config)
            for state in inner.state.values():
                state.setdefault("step", torch.tensor(0.0))


def bucket_aligned_world_state(opt) -> None:
    """Repair, on this DistributedOptimizer instance, megatron-core 0.16.1's fully_reshardable
    SAVE of a buffer with several buckets (its own TODO, distrib_optimizer.py l. 1508, issue #504).

    ``get_parameter_state_dp_zero`` lays each buffer's state out with the buckets back to back,
    their end padding dropped (l. 1110-1118), but ``sharded_param_state_fully_reshardable`` slices
    it at ``param_index_map``'s offsets, which count that padding: every parameter of a bucket
    after a padded one is read shifted (and its tail zero-filled, "param range exceeds unpadded
    buffer"). Only the save's values are wrong (a load writes through the parameter ranges), and
    a save and load at the same layout shift alike, so it shows when a checkpoint is resharded.
    The shared embedding gets a bucket of its own under the distributed optimizer (pipeline
    stages: the tied model's first chunk), so a one-layer chunk hits it. Here each bucket's
    slice is put back at its offset in the buffer (``bucket.offset``); with no end padding
    between buckets nothing moves."""
    if getattr(opt, "_rl_bucket_aligned", False) or not hasattr(opt, "get_parameter_state_dp_zero"):
        return
    original = opt.get_parameter_state_dp_zero

    def aligned(*args, **kwargs):
        state = original(*args, **kwargs)
        if state is None:
            return state
        for gbuf_idx, buffer in enumerate(opt.buffers):
            for world in state[gbuf_idx].values():
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    if key not in world:
                        continue
                    packed = world[key]
                    out = packed.new_zeros(buffer.numel)
                    start = 0
                    for bucket in buffer.buckets:
                        n = bucket.numel_unpadded
                        out[bucket.offset : bucket.offset + n] = packed[start : start + n]
                        start += n
                    world[key] = out
        return state

    opt.get_parameter_state_dp_zero = aligned
    opt._rl_bucket_aligned = True


def load_optimizer(optimizer, state) -> None:
    """``optimizer.load_state_dict`` of what ``dist_checkpointing.load`` returned, with two
    repairs for megatron-core 0.16.1 without Apex/TE (torch Adam, whose state has a ``step``):

    - ``DistributedOptimizer.load_state_dict`` gives every parameter of a group the SAME ``step``
      tensor (distrib_optimizer.py l. 820); torch Adam then increments it once per parameter per
      step and the bias correction of a resumed run drifts. Each parameter gets its own copy.
    - ``load_parameter_state_from_fully_reshardable`` copies every key of the parameter's Adam
      state from the checkpoint, ``step`` included, which the checkpoint keeps in the param
      groups instead (l. 940: KeyError 'step'). It runs with ``step`` set aside.
    """
    opts = optimizers(optimizer)
    states = [state] if len(opts) == 1 else [state[k] for k in sorted(state)]
    for opt, st in zip(opts, states):
        param_state = st.pop("param_state", None) if hasattr(opt, "get_parameter_state_dp_zero") else None
        opt.load_state_dict(st)
        if param_state is None:
            continue
        adam = opt.optimizer.state
        steps = {p: s.pop("step").clone() for p, s in adam.items() if torch.is_tensor(s.get("step"))}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                adam[p]["step"] = step
    if len(opts) > 1:
        optimizer._synchronize_steps()
