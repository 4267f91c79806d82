"""Issue 38 #2: exit signals end the run even when user code never returns.

Three real runs (embedded task, FSDP, one rank, ``--save``), started together; from their third
rollout on, their user code never returns (``tests/support/stuck_hooks.py``). Each gets SIGTERM
to its whole process group (as Slurm and Kubernetes send it) once stuck:

- H, a generate hook awaiting forever, overlapped loop (``--max-weight-staleness 1``): the abort
  cancels the hook's task; the run names the hook, saves the last complete rollout and exits 143
  (it used to hang: the signal was read only between two rollouts);
- W, a blocking ``rm(args, sample)`` judge, synchronous loop, ``--exit-signal-grace-s 20``: nothing
  can interrupt it; the run gives the generate up after a quarter of the grace, names the reward,
  saves and exits 143 within the grace;
- D, the same judge, overlapped loop, ``--exit-signal-grace-s 40``, a checkpoint per rollout, a
  second SIGTERM 1 s past ``REPEAT_WINDOW_S`` after the first (a copy within the window is the same
  request: ``test_exit_signal_copies.py``): the run exits at once with the resume line, before the
  first signal's give-up (10 s) (it used to end in ``SystemError`` from Ray's ``check_signals``).

Every run leaves no lock and no process. The bounds on the time to exit are the flag's (with a
wide margin for a loaded machine), never a measured one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from rl_plugin.checkpoint.layout import latest_step
from rl_plugin.errors import REPEAT_WINDOW_S
from tests.fast.cli.test_cli_faults import Proc, _gone, _names

HOOKS = Path(__file__).resolve().parents[2] / "support" / "stuck_hooks.py"
GRACE_S = 20  # the default: a quarter to give a stuck generate up, the rest to save and tear down
SECOND_GRACE_S = 40  # run D: the first signal alone would take at least a quarter of it
MARGIN_S = 20  # start-of-exit bookkeeping and Ray's teardown on a loaded 2-core machine


def _argv(d: Path, *extra):
    return [
        "--train-backend",
        "fsdp",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "12",
        "--output-dir",
        str(d / "out"),
        "--no-progress-bar",
        "--log-interval",
        "1",
        "--save",
        str(d / "ckpt"),
        "--save-interval",
        "100",
        "--exit-signal-grace-s",
        str(GRACE_S),
        *extra,
    ]


CASES = {
    "hook": ("--custom-generate-function-path", f"{HOOKS}:stuck_generate", "--max-weight-staleness", "1"),
    "reward": ("--custom-rm-path", f"{HOOKS}:stuck_rm"),
    "second": (
        "--custom-rm-path",
        f"{HOOKS}:stuck_rm",
        "--max-weight-staleness",
        "1",
        "--exit-signal-grace-s",
        str(SECOND_GRACE_S),
        "--save-interval",
        "1",  # a checkpoint per rollout: the resume line names one
    ),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stuck")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RL_PLUGIN_CACHE"] = str(tmp / "cache")
    procs = {name: Proc(_argv(tmp / name, *extra), tmp, env) for name, extra in CASES.items()}
    out = {}
    try:
        for name, p in procs.items():
            # overlapped, rollout 1's row waits for rollout 2, generated ahead: one row shows
            rows = 1 if "--max-weight-staleness" in CASES[name] else 2
            p.wait_for(lambda p=p, n=rows: sum(ln.startswith("step ") for ln in p.out) >= n, f"run {name}'s row {rows}")
        time.sleep(3)  # every run is in its third rollout now, stuck
        for name, p in procs.items():
            assert p.p.poll() is None, f"run {name} ended before the signal: {''.join(p.err)[-2000:]}"
            tree, t0 = p.tree(), time.monotonic()
            os.killpg(p.p.pid, signal.SIGTERM)
            if name == "second":
                time.sleep(REPEAT_WINDOW_S + 1.0)
                os.killpg(p.p.pid, signal.SIGTERM)
            rc = p.finish(timeout=GRACE_S + 120)
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


def _common(r):
    assert r["rc"] == 128 + signal.SIGTERM, r["err"][-3000:]
    assert "Traceback" not in r["err"] and "SystemError" not in r["err"], r["err"][-3000:]
    assert not r["lock"], "the output lock outlived the run"
    assert not r["left"], f"left after SIGTERM: {_names(r['left'])}"
    assert "resume with --load " in r["last"] and "(last checkpoint: step " in r["last"], r["last"]


def test_a_stuck_generate_hook_is_cancelled_named_and_the_last_rollout_saved(stopped):
    r = stopped["hook"]
    _common(r)
    assert r["seconds"] < GRACE_S + MARGIN_S, r["seconds"]
    assert r["last"].startswith("stopped by SIGTERM during rollout "), r["last"]
    assert "was aborted on request during the generate hook --custom-generate-function-path " in r["last"], r["last"]
    assert "stuck_generate at " in r["last"] and "; saved rollout " in r["last"], r["last"]
    assert r["step"] is not None and r["step"] >= 2


def test_a_stuck_reward_is_abandoned_within_the_grace_named_and_the_last_rollout_saved(stopped):
    """A blocking ``rm(args, sample)`` runs in the deadline worker's thread (``rollout.deadlines``), so
    the scorer awaiting it is cancelled by the abort at once; the stuck thread is left behind."""
    r = stopped["reward"]
    _common(r)
    assert r["seconds"] < GRACE_S + MARGIN_S, r["seconds"]
    assert "was aborted on request during the reward --custom-rm-path " in r["last"], r["last"]
    assert "stuck_rm" in r["last"] and "rm(args, sample)" in r["last"], r["last"]
    assert "; saved rollout 1 (step 2)" in r["last"] and r["step"] == 2, r["last"]


def test_a_second_signal_exits_at_once_with_the_resume_line(stopped):
    r = stopped["second"]
    _common(r)
    # at once: before the first signal's give-up (a quarter of the grace) could have ended it
    assert r["seconds"] < SECOND_GRACE_S / 4, r["seconds"]
    assert r["last"].startswith("aborted by a second signal (SIGTERM). "), r["last"]
