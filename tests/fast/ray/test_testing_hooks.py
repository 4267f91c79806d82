"""The train actors' test hooks, read once (``rl_plugin.ray.testing_hooks``): what the train group
forwards, how a rank parses them, and that each fires at its step only, on real processes (the
loop's fault tests, ``e2e/test_loop.py`` and ``cli/test_exit_signals.py``, run them through Ray)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import rl_plugin
from rl_plugin.ray.testing_hooks import (
    DRIVER_PID_ENV,
    FAULT_ENV,
    SIGNAL_ENV,
    STALE_ENGINE_ENV,
    StaleReceiver,
    TrainActorHooks,
    forwarded_env,
    stale_engine_at,
)
from rl_plugin.weight_sync import WeightPublisher, WeightReceiver, load_sync
from rl_plugin.weight_sync.handle import SyncRequest


def test_forwarded_env_takes_the_hooks_and_adds_the_driver_pid_for_the_signal():
    env = {FAULT_ENV: "1:3", "RL_PLUGIN_TRAIN_THREADS": "2", "HOME": "/root", "RL_PLUGIN_COLOCATION_TRACE": "/t"}
    assert forwarded_env(env) == {FAULT_ENV: "1:3", "RL_PLUGIN_TRAIN_THREADS": "2", "RL_PLUGIN_COLOCATION_TRACE": "/t"}
    assert forwarded_env({SIGNAL_ENV: "3"}, driver_pid=4242) == {SIGNAL_ENV: "3", DRIVER_PID_ENV: "4242"}


def test_from_env_parses_each_hook_once():
    assert TrainActorHooks.from_env({}) == TrainActorHooks()
    hooks = TrainActorHooks.from_env({FAULT_ENV: "1:3", SIGNAL_ENV: "5", DRIVER_PID_ENV: "77"})
    assert hooks == TrainActorHooks(kill_at=(1, 3), sigterm_driver_at=5, driver_pid=77)


def _rank_process(rank: int, step: int) -> int:
    """A process that runs rank ``rank``'s check before ``step`` with the kill hook at (1, 3)."""
    code = (
        "import threading\n"
        "from rl_plugin.ray.testing_hooks import TrainActorHooks\n"
        f"TrainActorHooks(kill_at=(1, 3)).before_step({rank}, {step}, threading.Event())\n"
    )
    root = os.path.dirname(os.path.dirname(rl_plugin.__file__))  # this checkout's package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode


def test_the_kill_hook_fires_on_its_rank_and_step_only():
    assert _rank_process(1, 3) == -signal.SIGKILL
    assert _rank_process(1, 2) == 0 and _rank_process(0, 3) == 0


def test_the_signal_hook_sends_sigterm_to_the_driver_then_waits_for_the_stop():
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hooks = TrainActorHooks(sigterm_driver_at=2, driver_pid=driver.pid)
        stop = threading.Event()
        hooks.before_step(0, 1, stop)  # another step: nothing
        hooks.before_step(1, 2, stop)  # another rank: nothing
        assert driver.poll() is None
        threading.Timer(0.3, stop.set).start()  # the driver's stop request
        t0 = time.monotonic()
        hooks.before_step(0, 2, stop)
        assert 0.2 < time.monotonic() - t0 < 30  # it waited for the stop request
        assert driver.wait(timeout=30) == -signal.SIGTERM
    finally:
        driver.kill()
        driver.wait()


class _Engine:
    def __init__(self):
        self.w = {"w": torch.zeros(4)}

    def update_weights(self, bucket):
        for name, t in bucket.items():
            self.w[name].copy_(t)

    def weights(self):
        return self.w


@pytest.mark.parametrize("claim, version", [(False, 1), (True, 2)])
def test_the_stale_receiver_leaves_the_engine_on_its_old_weights_at_its_sync_only(claim, version):
    engine, receiver = _Engine(), StaleReceiver(WeightReceiver(), at=2, claim=claim)
    pub = WeightPublisher("shared_memory")
    try:
        request = SyncRequest(buffer_bytes=1024, transport="shared_memory", fingerprint=True)
        first = load_sync(engine, receiver, pub.publish({"w": torch.ones(4)}, request))
        assert first["version"] == 1 and torch.equal(engine.w["w"], torch.ones(4))  # sync 1 passes through
        second = load_sync(engine, receiver, pub.publish({"w": torch.full((4,), 2.0)}, request))
    finally:
        pub.close()
    assert torch.equal(engine.w["w"], torch.ones(4)) and second["bytes"] == 0.0  # sync 2: the old weights kept
    assert second["version"] == version  # "V": the old version; "V:weights": the new one claimed


def test_stale_engine_at_parses_the_sync_and_the_kind():
    assert stale_engine_at({}) is None
    assert stale_engine_at({STALE_ENGINE_ENV: "3"}) == (3, False)
    assert stale_engine_at({STALE_ENGINE_ENV: "2:weights"}) == (2, True)
    with pytest.raises(ValueError, match="expected 'V' or 'V:weights'"):
        stale_engine_at({STALE_ENGINE_ENV: "2:other"})
