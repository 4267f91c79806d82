"""One live run per output directory: ``<output-dir>/.rl_plugin.lock``.

Two runs writing the same metrics file and plot interleave or rename each other's files. The
driver takes this lock in its first second and releases it at the end. The lock file holds the
owner's pid, host, the pid's start time (so a recycled pid is not mistaken for the owner) and its
command line. A second run finds it and refuses, naming them; a lock whose pid is dead on this
host (the run was SIGKILLed) is stale and taken over. A lock from another host cannot be checked
from here: the message says how to remove it if that run is gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from rl_plugin.errors import fail

LOCK_NAME = ".rl_plugin.lock"


def _start_ticks(pid: int) -> Optional[int]:
    """The pid's start time in clock ticks since boot (Linux /proc), None elsewhere/if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, ticks: Optional[int]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_ticks(pid)
    return ticks is None or now is None or now == ticks


class RunLock:
    def __init__(self, directory):
        self.path = Path(directory) / LOCK_NAME
        self.held = False

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_ticks": _start_ticks(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv,
        }
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_clear()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        fail(
            f"--output-dir {self.path.parent}",
            f"could not take the run lock {self.path}",
            f"remove {self.path} if no run uses the directory",
        )
        return self

    def _refuse_or_clear(self) -> None:
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            owner = {}  # half-written by a run that died while taking it: stale
        pid, host = owner.get("pid"), owner.get("host")
        if pid is not None and host == socket.gethostname() and _alive(int(pid), owner.get("start_ticks")):
            fail(
                f"--output-dir {self.path.parent}",
                f"another run is writing there: pid {pid} on {host}, started {owner.get('started')} "
                f"({' '.join(owner.get('argv', []))[:200]}); two runs would interleave the metrics file and the plot",
                f"wait for it to finish or stop it (kill -INT {pid}), or pass another --output-dir",
            )
        if pid is not None and host not in (None, socket.gethostname()):
            fail(
                f"--output-dir {self.path.parent}",
                f"a run on host {host} (pid {pid}, started {owner.get('started')}) holds {self.path}",
                f"if that run is no longer alive, delete {self.path}; else pass another --output-dir",
            )
        print(f"{self.path}: taking over the lock of a run that is gone (pid {pid} on {host})", flush=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def release(self) -> None:
        if self.held:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False
