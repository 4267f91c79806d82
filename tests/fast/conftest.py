"""Fixtures shared by the whole suite.

- ``run_world``: ``run_world(fn, world_size, *args)`` of ``tests.support.harness``: ``world_size``
  fresh processes in one gloo group on a free port; ``fn`` must be module-level (the rank imports
  it by its module name, e.g. ``tests.fast.loss.test_metrics``). In the suite the ranks are forked
  from a forkserver that imported ``FORKSERVER_PRELOAD`` once (``harness.use_forkserver``): a
  spawned rank spent ~4.5 s importing torch, transformers and megatron-core, every call.
- ``free_port``: a function returning a free TCP port on 127.0.0.1.
- ``tiny_checkpoint``: ``tiny_checkpoint(family="qwen2", **config)`` -> the path of a seeded tiny
  Hugging Face checkpoint, written once per session (``rl_plugin.models.tiny``); read only.
- ``tiny_qwen2``: the default tiny Qwen2 checkpoint (``tiny_checkpoint()``).
- ``own_signal_mask`` (autouse): each test starts and ends with the signal mask the session had,
  so a test of the exit signals that blocks them (``loop.exit_request``) cannot leak the block into
  the next test's subprocesses (a child inherits it: a SIGTERM to it would then never arrive).

The flags of exact SGD are ``tests.support.flags.EXACT_SGD`` (``exact_sgd(lr=...)``), a constant
rather than a fixture: the workers ``run_world`` spawns use them, and fixtures do not reach them.

The helpers themselves live in ``tests/support`` (a package: imported as ``tests.support.X``).
"""

from __future__ import annotations

import signal

import pytest

from tests.support import harness

# what the ranks of run_world import (the backends pull in transformers, megatron-core, mbridge)
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "transformers",
    "rl_plugin.backends.fsdp.backend",
    "rl_plugin.backends.megatron.backend",
    "tests.support.harness",
    "tests.support.fsdp_common",
    "tests.support.megatron_common",
]
harness.use_forkserver(FORKSERVER_PRELOAD)
SESSION_MASK = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the mask the suite started with


@pytest.fixture(autouse=True)
def own_signal_mask():
    signal.pthread_sigmask(signal.SIG_SETMASK, SESSION_MASK)
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, SESSION_MASK)


@pytest.fixture(scope="session")
def run_world():
    return harness.run_world


@pytest.fixture(scope="session")
def free_port():
    return harness.free_port


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from tests.support.fsdp_common import tiny_checkpoint as make

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return lambda family="qwen2", **config: make(root, family, **config)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint):
    return tiny_checkpoint()
