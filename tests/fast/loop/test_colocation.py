"""Issue 37 item 2: the colocated loop's phases, in order, from a real run.

``--colocate --offload-train`` on the embedded task: real Ray, the real hf engine inside the
rollout manager, one gloo training rank. Every party records its phases
(``rl_plugin.phases``, ``RL_PLUGIN_COLOCATION_TRACE``): per rollout k the trainer
offloads before the engines wake, the engines load the weights the last train call published
(their weights woken alone for it), wake the rest, generate rollout k and sleep, and the trainer
reloads before it trains on k; each exactly once per rollout; the eval after the last rollout
offloads, wakes, loads and sleeps the same way. That the offload changes nothing the trainer
computes is ``tests/fast/backends/test_offload.py`` (bitwise, both backends).
"""

from __future__ import annotations

import os
import subprocess
import sys


def _train(out, trace, *flags):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RL_PLUGIN_COLOCATION_TRACE"] = str(trace)
    return subprocess.run(
        [sys.executable, "-m", "rl_plugin.train", "--output-dir", str(out), "--no-progress-bar", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _rollout_phases(trace):
    """The events of each rollout: from the trainer's offload before its generate to its train."""
    events = trace.read_text().splitlines()
    first = events.index("train0.offload")
    start, rollouts = events[:first], []
    for e in events[first:]:
        if e == "train0.offload":
            rollouts.append([])
        rollouts[-1].append(e)
    return start, rollouts


def test_colocated_phases_run_in_order_once_per_rollout(tmp_path):
    flags = ["--colocate", "--num-rollout", "2", "--offload-train"]
    done = _train(tmp_path / "offload", tmp_path / "offload.trace", *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    start, rollouts = _rollout_phases(tmp_path / "offload.trace")
    # start-up: the engine sleeps as soon as it is built; the first sync wakes its weights alone
    assert start == ["engine.sleep", "engine.wake_up weights", "engine.load 1", "engine.sleep"]
    *rollouts, evaluation = rollouts
    assert len(rollouts) == 2
    for k, phases in enumerate(rollouts):
        load = [] if k == 0 else ["engine.wake_up weights", f"engine.load {k + 1}"]
        assert phases == [
            "train0.offload",
            *load,
            "engine.wake_up",
            f"engine.generate {k}",
            "engine.sleep",
            "train0.reload",
            "train0.train",
        ], (k, phases)
    assert evaluation == [
        "train0.offload",
        "engine.wake_up weights",
        "engine.load 3",
        "engine.wake_up",
        "engine.sleep",
    ]
