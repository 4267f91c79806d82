"""One live run per output directory (``rl_plugin.loop.run_lock``): the lock file's record, a
live owner refused by name, a lock of another host refused with how to remove it, and stale
locks (dead pid, recycled pid, half-written file) taken over. (The live/dead-pid pair from the
user's side: ``tests/fast/cli/test_first_hour.py``.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from rl_plugin.errors import RLArgumentError
from rl_plugin.loop.run_lock import LOCK_NAME, RunLock, _start_ticks


def _write_owner(directory, **owner):
    (directory / LOCK_NAME).write_text(json.dumps(owner))


def test_the_lock_file_records_the_owner_and_release_removes_it(tmp_path):
    lock = RunLock(tmp_path / "out").acquire()  # the directory is created
    record = json.loads((tmp_path / "out" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["start_ticks"] == _start_ticks(os.getpid()) and record["argv"] == sys.argv
    assert lock.held
    lock.release()
    assert not (tmp_path / "out" / LOCK_NAME).exists() and not lock.held
    lock.release()  # twice: nothing to do


def test_a_live_owner_is_refused_naming_pid_command_and_fix(tmp_path):
    _write_owner(
        tmp_path, pid=os.getpid(), host=socket.gethostname(), start_ticks=_start_ticks(os.getpid()),
        started="2026-01-02 03:04:05", argv=["train.py", "--lr", "1e-6"],
    )  # fmt: skip
    with pytest.raises(RLArgumentError) as err:
        RunLock(tmp_path).acquire()
    assert str(err.value) == (
        f"--output-dir {tmp_path}: another run is writing there: pid {os.getpid()} on {socket.gethostname()}, "
        "started 2026-01-02 03:04:05 (train.py --lr 1e-6); two runs would interleave the metrics file and the plot. "
        f"Fix: wait for it to finish or stop it (kill -INT {os.getpid()}), or pass another --output-dir."
    )
    assert json.loads((tmp_path / LOCK_NAME).read_text())["argv"] == ["train.py", "--lr", "1e-6"]  # left as it was


def test_a_lock_of_another_host_is_refused_with_how_to_remove_it(tmp_path):
    _write_owner(tmp_path, pid=4242, host="other-node-7", started="yesterday", argv=[])
    with pytest.raises(RLArgumentError) as err:
        RunLock(tmp_path).acquire()
    path = tmp_path / LOCK_NAME
    assert str(err.value) == (
        f"--output-dir {tmp_path}: a run on host other-node-7 (pid 4242, started yesterday) holds {path}. "
        f"Fix: if that run is no longer alive, delete {path}; else pass another --output-dir."
    )


def test_a_recycled_pid_is_not_the_owner(tmp_path, capsys):
    """Our own (live) pid with another start time: the pid was reused, the lock is stale."""
    ticks = _start_ticks(os.getpid())
    assert ticks is not None  # Linux /proc
    _write_owner(tmp_path, pid=os.getpid(), host=socket.gethostname(), start_ticks=ticks + 1, argv=[])
    lock = RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["start_ticks"] == ticks
    out = capsys.readouterr().out
    assert f"taking over the lock of a run that is gone (pid {os.getpid()} on {socket.gethostname()})" in out
    lock.release()


def test_a_dead_pid_or_a_half_written_lock_is_taken_over(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_owner(tmp_path, pid=dead.pid, host=socket.gethostname(), start_ticks=None, argv=[])
    RunLock(tmp_path).acquire().release()
    assert f"(pid {dead.pid} on {socket.gethostname()})" in capsys.readouterr().out
    (tmp_path / LOCK_NAME).write_text('{"pid": 12')  # the owner died while writing it
    lock = RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "(pid None on None)" in capsys.readouterr().out
    lock.release()
