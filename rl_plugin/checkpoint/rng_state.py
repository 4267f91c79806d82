"""The random-number-generator state of one process, as checkpoints save and restore it.

Four streams: Python's ``random``, NumPy's global generator, torch's CPU generator and, when CUDA
is present, every visible CUDA device's generator. A backend adds its own (Megatron: the
model-parallel RNG tracker) beside these keys. ``set_rng_state`` accepts a state saved without
CUDA (no ``"cuda"`` key, or ``None`` as older Megatron checkpoints wrote it) on any machine, and
then leaves the CUDA generators as they are.
"""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
