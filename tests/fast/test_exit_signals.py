"""Issue 28 #1: a preempted run saves and says how to resume (``--exit-signal-handler``).

Real processes: run S (embedded task, FSDP, one rank, ``--save-interval`` far away) gets SIGTERM
after its second step, as Slurm or Kubernetes send it on preemption. It must finish the train call
in progress, write a checkpoint at the step it reached, print the last checkpoint and the resume
command, release the output lock and exit 143, leaving no process behind. The printed command
resumes it to the end, and the resumed run's metrics equal an uninterrupted run's line for line.
The second-signal abort and ``--exit-duration-in-mins`` are checked on ``ExitRequest`` itself.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time

import pytest

from rl_plugin.errors import Interrupted
from rl_plugin.loop.checkpoint import latest_step
from rl_plugin.loop.exit_request import ExitRequest
from tests.fast.test_cli_faults import Proc, _gone, _names

NUM_ROLLOUT = 16  # rollouts take ~0.1 s here: the signal must land well before the last


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)  # each run starts (and must end) its own local cluster
    e["RL_PLUGIN_CACHE"] = str(tmp_path / "cache")
    return e


def _argv(d, *extra):
    return [
        "--train-backend",
        "fsdp",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        str(NUM_ROLLOUT),
        "--output-dir",
        str(d / "out"),
        "--no-progress-bar",
        "--log-interval",
        "1",
        *extra,
    ]


def _rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_sigterm_saves_at_its_step_and_the_printed_command_resumes_exactly(env, tmp_path):
    s_dir, r_dir = tmp_path / "s", tmp_path / "r"
    s = Proc(_argv(s_dir, "--save", str(s_dir / "ckpt"), "--save-interval", "100"), tmp_path, env)
    try:
        s.wait_for(lambda: sum(ln.startswith("step ") for ln in s.out) >= 2, "run S's second step")
        tree = s.tree()
        os.kill(s.p.pid, signal.SIGTERM)  # the driver alone, as Kubernetes does
        assert s.finish(timeout=300) == 128 + signal.SIGTERM
    finally:
        if s.p.poll() is None:
            os.killpg(s.p.pid, signal.SIGKILL)
    err = "".join(s.err)
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert "received SIGTERM: finishing the optimizer steps in progress, then writing a checkpoint" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    step = latest_step(s_dir / "ckpt")
    rows = _rows(s_dir / "out" / "metrics.jsonl")
    assert step is not None and step == rows[-1]["step"] >= 2, (step, len(rows))  # the signal's step, saved
    assert last.startswith(f"stopped by SIGTERM after rollout {rows[-1]['rollout_id']} (step {step})"), last
    assert f"resume with --load {s_dir / 'ckpt'} (last checkpoint: step {step}): rl-plugin-train " in last, last
    assert not (s_dir / "out" / ".rl_plugin.lock").exists()
    left = _gone(tree)
    assert not left, f"left after SIGTERM: {_names(left)}"

    cmd = shlex.split(last.split(f"(last checkpoint: step {step}): ", 1)[1])
    resumed = Proc(cmd[1:], tmp_path, env)
    full = Proc(_argv(r_dir), tmp_path, env)  # the uninterrupted run, meanwhile
    assert resumed.finish(timeout=900) == 0, "".join(resumed.err)[-3000:]
    assert full.finish(timeout=900) == 0, "".join(full.err)[-3000:]
    assert _rows(s_dir / "out" / "metrics.jsonl") == _rows(r_dir / "out" / "metrics.jsonl")


def test_a_second_signal_aborts_at_once():
    req = ExitRequest(handle_signals=True, duration_mins=None, will_save=True)
    req.install()
    try:
        assert req.reason() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert req.reason() == "stopped by SIGUSR1" and req.exit_code() == 128 + signal.SIGUSR1
        with pytest.raises(Interrupted, match="aborted by a second signal \\(SIGHUP\\)") as info:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)  # the handler runs between bytecodes
        assert info.value.exit_code == 128 + signal.SIGHUP
    finally:
        req.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_exit_duration_stops_with_exit_code_0():
    req = ExitRequest(handle_signals=False, duration_mins=0.5 / 60, will_save=False)
    assert req.reason() is None
    time.sleep(0.6)
    assert req.reason() == "stopped after --exit-duration-in-mins 0.00833333" and req.exit_code() == 0


def test_exit_flags_are_validated():
    from tests.fast.flag_rules import assert_refused

    assert_refused("--exit-duration-in-mins 0", ["--exit-duration-in-mins", "positive", "Fix:"])
