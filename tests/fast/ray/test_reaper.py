"""The watchdog that takes a locally started Ray cluster down with the driver
(``rl_plugin.ray.reaper``): the descendant walk over a process table, and the real watchdog
process: what it records (the driver's children started after it, then the heads' descendants),
what it kills when the pipe closes, what it leaves alone, and the weight segments it unlinks."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from rl_plugin.ray.reaper import GRACE_S, WEIGHT_SEGMENTS, _stat, children, descendants, process_table, start_reaper


def test_descendants_walk_the_table_from_the_roots():
    # pid: (ppid, start ticks)
    table = {10: (1, 100), 11: (10, 101), 12: (11, 102), 13: (10, 103), 20: (1, 200), 21: (20, 201)}
    assert descendants([10], table) == {10: 100, 11: 101, 12: 102, 13: 103}
    assert descendants([11, 21], table) == {11: 101, 12: 102, 21: 201}
    assert descendants([99], table) == {}  # a root no longer alive
    assert descendants([], table) == {}


def test_the_process_table_sees_this_process_and_its_children():
    child = subprocess.Popen(["sleep", "30"])
    try:
        table = process_table()
        assert table[child.pid][0] == os.getpid() and table[os.getpid()] == _stat(os.getpid())
        assert child.pid in children(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert _stat(child.pid) is None


def _gone(pid: int) -> bool:
    return _stat(pid) is None  # dead, or a zombie waiting for its parent


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watchdog reads /proc (Linux)")
def test_the_watchdog_kills_the_cluster_it_recorded_and_only_that():
    before = subprocess.Popen(["sleep", "60"])  # the driver's child from before: not the watchdog's business
    reaper = start_reaper()
    assert reaper is not None
    # "ray.init()": a head process that starts a child of its own (an agent left under PID 1 otherwise)
    head = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    agent = int(head.stdout.readline())
    directory, prefix = WEIGHT_SEGMENTS
    segment = Path(directory) / f"{prefix}.{head.pid}.0"
    segment.write_bytes(b"weights")
    time.sleep(1.5)  # the watchdog polls every 0.5 s while the cluster starts
    reaper.set_heads([head.pid])
    time.sleep(1.0)
    after = subprocess.Popen(["sleep", "60"])  # started after the heads are known, not below them: left alone
    try:
        t0 = time.monotonic()
        reaper.stop()  # as the driver's death closes the pipe
        reaper.proc.wait(timeout=GRACE_S + 10)
        took = time.monotonic() - t0
        assert took >= GRACE_S  # a clean ray.shutdown() gets its grace period
        assert head.wait(timeout=5) == -9 and _gone(agent)
        assert not segment.exists()
        assert before.poll() is None and after.poll() is None
    finally:
        for p in (before, after, head):
            p.kill()
            p.wait()
        if not _gone(agent):
            os.kill(agent, 9)
        segment.unlink(missing_ok=True)
    assert reaper.proc.returncode == 0
