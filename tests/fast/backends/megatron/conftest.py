"""Fixtures of the Megatron backend's tests: one LoRA rank's adapter state, spawned once for the
session (``tests.support.megatron_lora_state``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lora_adapter_state(tiny_qwen2):
    from tests.support.harness import run_world
    from tests.support.megatron_lora_state import adapter_state_worker

    return run_world(adapter_state_worker, 1, str(tiny_qwen2))[0]
