"""The RNG-state helper both backends' checkpoints use: restoring a saved state makes Python,
NumPy and torch draw the same numbers again; a state saved without CUDA (absent, or None as
older Megatron checkpoints wrote it) restores on any machine."""

from __future__ import annotations

import random

import numpy as np
import torch

from rl_plugin.checkpoint.rng_state import rng_state, set_rng_state


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_restored_state_repeats_every_stream():
    state = rng_state()
    first = _draw()
    assert _draw() != first  # the streams moved on
    set_rng_state(state)
    assert _draw() == first
    set_rng_state({**state, "cuda": None})  # an older Megatron checkpoint's form
    assert _draw() == first
    set_rng_state({k: v for k, v in state.items() if k != "cuda"})
    assert _draw() == first
