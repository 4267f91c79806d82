"""Issue 16: faults of the real command line, in spawned ``rl-plugin-train`` processes.

One long run A (embedded task, FSDP, one rank, a checkpoint per rollout, no progress bar) is
started in its own session, as a shell starts a job. While it trains:

- #14: it prints a compact metrics line every --log-interval steps (it used to print nothing);
- #3: a second run with the same --output-dir is refused, naming A's pid and host (it used to
  rename A's live metrics file);
- #11: Ctrl-C (SIGINT to A's process group, as a terminal sends it) stops A as SIGTERM does (issue
  44 #19: it saves, exit 130) with one line naming the last checkpoint and the --load command, no
  traceback, and none of A's processes left;
- #12: run C, resumed with that command, is SIGKILLed once its local Ray cluster is up: every
  process of that cluster, the dashboard and runtime-env agents included, must end with it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rl_plugin.checkpoint.layout import latest_step
from rl_plugin.ray.reaper import descendants, process_table

TRAIN = Path(sys.executable).with_name("rl-plugin-train")
START_TIMEOUT = 400  # s: Ray + model start-up on a loaded 2-core machine


def _terminal_signals():
    """In the child before exec: no signal blocked, as a shell starts a command. A signal mask is
    inherited across exec, and in-process code of earlier tests can leave SIGINT blocked in the
    pytest process; the run would then never see the Ctrl-C this module sends."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


class Proc:
    """A spawned trainer whose stdout/stderr are drained by threads (a full pipe would block it);
    ``wrap``: a launcher it runs under (``p`` is then the launcher's process)."""

    def __init__(self, argv, cwd, env, wrap=()):
        cmd = [str(TRAIN)] if TRAIN.exists() else [sys.executable, "-m", "rl_plugin.train"]
        self.p = subprocess.Popen(
            [*wrap, *cmd, *argv],  # wrap: a launcher in front (``timeout``)
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_terminal_signals,
        )
        self.out, self.err = [], []
        self._threads = [
            threading.Thread(target=self._drain, args=(s, buf), daemon=True)
            for s, buf in ((self.p.stdout, self.out), (self.p.stderr, self.err))
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _drain(stream, buf):
        for line in stream:
            buf.append(line)

    def wait_for(self, cond, what, timeout=START_TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(
            f"{what} did not happen (rc {self.p.poll()}):\n{''.join(self.out)[-3000:]}\n{''.join(self.err)[-3000:]}"
        )

    def finish(self, timeout=120):
        rc = self.p.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return rc

    def tree(self):
        return descendants([self.p.pid], process_table())


def _gone(tree, timeout=30.0):
    """Wait until no process of ``tree`` (pid -> start ticks) is alive; returns the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        table = process_table()
        alive = {p: t for p, t in tree.items() if p in table and table[p][1] == t}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _names(pids):
    out = []
    for p in pids:
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:80].decode(errors="replace")
        except OSError:
            continue
        out.append(f"{p}:{cmdline}")
    return out


def _kill(tree):
    """SIGKILL what is left of ``tree`` (only a pid whose start time still matches: no reused pid)."""
    table = process_table()
    for p, ticks in tree.items():
        if p not in table or table[p][1] != ticks:
            continue
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)  # each run starts (and must end) its own local cluster
    e["RL_PLUGIN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    return e


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, env):
    d = tmp_path_factory.mktemp("a")
    argv = [
        "--train-backend",
        "fsdp",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "100000",  # never reached: the tests stop A; 1000 could finish under load while test B waits
        "--save",
        str(d / "ckpt"),
        "--save-interval",
        "1",
        "--output-dir",
        str(d / "out"),
        "--no-progress-bar",
        "--log-interval",
        "2",
    ]
    a = Proc(argv, d, env)
    try:
        a.wait_for(lambda: (latest_step(d / "ckpt") or 0) >= 4, "run A's checkpoint of step 4")
        yield a, d
    finally:
        if a.p.poll() is None:
            tree = a.tree()
            os.killpg(a.p.pid, signal.SIGKILL)
            _kill(tree)


def test_metrics_line_every_log_interval_without_progress_bar(run_a):
    a, _ = run_a
    lines = lambda: [ln for ln in a.out if ln.startswith("step ")]  # noqa: E731
    a.wait_for(
        lambda: len(lines()) >= 2, "two metrics lines on stdout", timeout=20
    )  # printed before the save of their step
    lines = lines()
    assert re.match(
        r"step 2 \| rollout 1 \| reward [0-9.]+ \| loss \S+ \| grad_norm \S+ \| .*gen [0-9.]+s reward [0-9.]+s train [0-9.]+s",
        lines[0],
    ), lines
    assert [int(ln.split()[1]) for ln in lines[:2]] == [2, 4]  # --log-interval 2: every other step


def test_second_live_run_in_the_same_output_dir_is_refused(run_a, env, tmp_path):
    a, d = run_a
    b = Proc(
        ["--train-backend", "fsdp", "--num-rollout", "1", "--output-dir", str(d / "out"), "--no-progress-bar"],
        tmp_path,
        env,
    )
    assert b.finish(timeout=300) == 2
    err = "".join(b.err)
    assert f"another run is writing there: pid {a.p.pid} on {socket.gethostname()}" in err and "Fix:" in err, err
    assert a.p.poll() is None and not list((d / "out").glob("*.prev*"))  # A untouched


def test_ctrl_c_ends_with_one_line_then_sigkill_takes_the_cluster_down(run_a, env):
    a, d = run_a
    tree = a.tree()
    os.killpg(a.p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert a.finish() == 130
    err = "".join(a.err)
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert last.startswith("stopped by SIGINT "), err[-3000:]
    step = latest_step(d / "ckpt")
    assert f"resume with --load {d / 'ckpt'} (last checkpoint: step {step}): rl-plugin-train " in last, last
    left = _gone(tree)
    assert not left, f"left after Ctrl-C: {_names(left)}"

    # #12: resume with the printed command, then SIGKILL the driver once its cluster is up.
    cmd = shlex.split(last.split(f"(last checkpoint: step {step}): ", 1)[1])
    assert cmd[-2:] == ["--load", str(d / "ckpt")]
    c = Proc(cmd[1:], d, env)
    tree = {}
    try:

        def agents_up():
            names = _names(c.tree())
            return any("RuntimeEnvAgent" in n for n in names) and any("DashboardAgent" in n for n in names)

        c.wait_for(agents_up, "run C's Ray agents")
        time.sleep(2)  # the watchdog records the cluster's processes every 0.5 s at first
        tree = c.tree()
        os.kill(c.p.pid, signal.SIGKILL)
        c.finish()
        left = _gone(tree)
        assert not left, f"left after SIGKILL of the driver: {_names(left)}"
    finally:  # never leave this test's processes behind, pass or fail
        _kill({**tree, **(c.tree() if c.p.poll() is None else {})})
