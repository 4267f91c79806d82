"""Issue 44 #12, #18, #19: one request to stop is saved, however it arrives.

Three real runs (embedded task, FSDP, one rank, ``--save`` with ``--save-interval`` far away, so
any checkpoint is the exit's own), started together:

- T (#18) runs under GNU ``timeout``, which is sent SIGTERM once the run trains: ``timeout``
  forwards it to the run, then to its whole process group (the run again), as it does when its
  duration ends; Slurm and Kubernetes signal every process of the job the same way. The copy used
  to count as a second signal: the run aborted at once with nothing saved. Now it saves and exits
  143 (``timeout`` passes the run's status on).
- C (#19, #18) gets Ctrl-C (SIGINT to its process group, as a terminal sends it) and, 0.2 s later,
  a copy of it: it saves like SIGTERM and exits 130 (it used to end with "interrupted (Ctrl-C)",
  no checkpoint; the copy alone aborted it with nothing saved).
- A (#12) has a rollout manager whose control thread never answers
  (``RL_PLUGIN_FAULT_ABORT_HANGS``) and gets SIGTERM from its rank 0 as that rank is about to run
  step 3 (``RL_PLUGIN_FAULT_SIGTERM_DRIVER_AT_STEP``), with ``--exit-signal-grace-s 9``: the stop
  request reaches the ranks first, step 3 never runs and the checkpoint of step 2 is complete
  within the grace. The run used to wait 10 s on the abort before asking the ranks: the grace
  ended first and nothing was saved.

A second signal after ``REPEAT_WINDOW_S`` still aborts at once (``test_exit_signals_stuck.py``,
``tests/fast/loop/test_exit_request.py``). Every run leaves no lock and no process.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from rl_plugin.checkpoint.layout import latest_step
from rl_plugin.loop.exit_request import REPEAT_WINDOW_S
from rl_plugin.ray.rollout_client import ABORT_HANGS_ENV
from rl_plugin.ray.testing_hooks import SIGNAL_ENV
from tests.fast.cli.test_cli_faults import Proc, _gone, _names

GRACE_S = 9  # run A: under the 10 s the exit used to wait on the abort before stopping the ranks
COPY_AFTER_S = 0.2  # run C: the copy of the Ctrl-C, well inside the window
assert COPY_AFTER_S < REPEAT_WINDOW_S / 2


def _argv(d: Path, *extra):
    return [
        *("--train-backend", "fsdp", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
        *("--num-rollout", "100000", "--output-dir", str(d / "out"), "--no-progress-bar", "--log-interval", "1"),
        *("--save", str(d / "ckpt"), "--save-interval", "100000"),
        *extra,
    ]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    if shutil.which("timeout") is None:
        pytest.skip("GNU timeout is not installed")
    tmp = tmp_path_factory.mktemp("copies")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RL_PLUGIN_CACHE"] = str(tmp / "cache")
    procs = {
        "timeout": Proc(_argv(tmp / "timeout"), tmp, env, wrap=("timeout", "-s", "TERM", "3600")),
        "ctrl_c": Proc(_argv(tmp / "ctrl_c"), tmp, env),
        "abort": Proc(
            _argv(tmp / "abort", "--exit-signal-grace-s", str(GRACE_S)),
            tmp,
            {**env, SIGNAL_ENV: "3", ABORT_HANGS_ENV: "1"},
        ),
    }
    out = {}
    try:
        for name, p in procs.items():
            p.wait_for(lambda p=p: any(ln.startswith("step ") for ln in p.out), f"run {name}'s first step")
        for name, p in procs.items():
            tree, t0 = p.tree(), time.monotonic()
            if name == "timeout":
                os.kill(p.p.pid, signal.SIGTERM)  # to `timeout`: it signals the run, then its group
            elif name == "ctrl_c":
                os.killpg(p.p.pid, signal.SIGINT)
                time.sleep(COPY_AFTER_S)
                os.killpg(p.p.pid, signal.SIGINT)
            rc = p.finish(timeout=600)  # run A signals itself at step 3
            err = "".join(p.err)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            out[name] = {
                "rc": rc,
                "seconds": time.monotonic() - t0,
                "err": err,
                "last": lines[-1] if lines else "",
                "lock": (tmp / name / "out" / ".rl_plugin.lock").exists(),
                "step": latest_step(tmp / name / "ckpt"),
                "left": _gone(tree),
            }
    finally:
        for p in procs.values():
            if p.p.poll() is None:
                os.killpg(p.p.pid, signal.SIGKILL)
    return out


def _saved(r, signame: str):
    assert "Traceback" not in r["err"] and "aborted by a second signal" not in r["err"], r["err"][-3000:]
    assert r["err"].count(f"received {signame}: stopping the rollout in progress, writing the last") == 1, r["err"]
    assert r["step"] is not None and r["step"] >= 1, r["err"][-3000:]
    assert r["last"].startswith(f"stopped by {signame} "), r["last"]
    assert f"(last checkpoint: step {r['step']}): rl-plugin-train " in r["last"], r["last"]
    assert not r["lock"], "the output lock outlived the run"
    assert not r["left"], f"left after {signame}: {_names(r['left'])}"


def test_a_run_under_gnu_timeout_saves_when_the_group_is_signalled_too(stopped):
    r = stopped["timeout"]
    assert r["rc"] == 128 + signal.SIGTERM, r["err"][-3000:]
    _saved(r, "SIGTERM")


def test_ctrl_c_saves_like_sigterm_and_its_copy_is_the_same_request(stopped):
    r = stopped["ctrl_c"]
    assert r["rc"] == 128 + signal.SIGINT == 130, r["err"][-3000:]
    _saved(r, "SIGINT")


def test_the_ranks_stop_and_the_save_completes_while_the_abort_never_answers(stopped):
    r = stopped["abort"]
    assert r["rc"] == 128 + signal.SIGTERM, r["err"][-3000:]
    # the stop reached rank 0 while it waited before step 3, and step 2's checkpoint is complete
    # (a save the grace's watchdog had cut would have left only a .partial)
    assert r["step"] == 2, r["err"][-3000:]
    assert not r["lock"] and not r["left"], (r["lock"], _names(r["left"]))
    if "did not stop within --exit-signal-grace-s" not in r["err"]:  # the teardown too fit in the grace
        assert r["last"].startswith(
            "stopped by SIGTERM during rollout 2: the train call stopped before its optimizer step 1 of 1; "
            "saved rollout 1 (step 2)"
        ), r["last"]
