"""A watchdog that takes a locally started Ray cluster down with the driver, however it ends.

``ray.init()`` starts the cluster's head processes (gcs_server, raylet, monitors) as children of
the driver; raylet starts the dashboard and runtime-env agents. When the driver is SIGKILLed,
the head processes die with it but the agents are left running under PID 1 (and ignore
SIGTERM). So ``init_ray`` starts this process in its own session (a terminal's Ctrl-C does not
reach it) with a pipe from the driver on stdin: it records the head processes and all their
descendants (every second at first, then every 5 s), and when the pipe reaches EOF (the driver
closed it after ``ray.shutdown()``, or died) it SIGKILLs every recorded process that is still
the same process (pid and start time match), then exits.

Linux only (it reads ``/proc``); elsewhere ``start_reaper`` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

GRACE_S = 2.0  # after EOF: let a clean ray.shutdown() finish before killing what is left


def _stat(pid: int):
    """(ppid, start ticks) of a live process, else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def process_table() -> Dict[int, tuple]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                out[int(entry)] = st
    return out


def children(pid: int) -> List[int]:
    return [p for p, (ppid, _) in process_table().items() if ppid == pid]


def descendants(roots: Iterable[int], table: Dict[int, tuple]) -> Dict[int, int]:
    """{pid: start ticks} of ``roots`` and everything below them in ``table``."""
    kids: Dict[int, List[int]] = {}
    for p, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(p)
    out, todo = {}, [r for r in roots if r in table]
    while todo:
        p = todo.pop()
        if p not in out:
            out[p] = table[p][1]
            todo.extend(kids.get(p, []))
    return out


def watch(heads: List[int]) -> None:
    tracked: Dict[int, int] = {}
    start = time.monotonic()
    while True:
        table = process_table()
        roots = [p for p in list(heads) + list(tracked) if p in table and table[p][1] == tracked.get(p, table[p][1])]
        tracked.update(descendants(roots, table))
        period = 1.0 if time.monotonic() - start < 60 else 5.0
        ready, _, _ = select.select([sys.stdin], [], [], period)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: the driver is done or dead
    time.sleep(GRACE_S)
    for pid, ticks in tracked.items():
        st = _stat(pid)
        if st is not None and st[1] == ticks:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Reaper:
    """The driver's end: the pipe whose closing (or the driver's death) tells the watchdog to act."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def stop(self) -> None:
        """Close the pipe; the watchdog (its own session) cleans up after ``GRACE_S`` and exits,
        whether or not the driver is still there."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


def start_reaper(heads: List[int]) -> Optional[Reaper]:
    if not Path("/proc/self/stat").exists() or not heads:
        return None
    # run as a script (stdlib only), so it needs nothing on the path; no stdout/stderr of the
    # driver held open (a pipe reader of the driver's output must see EOF when the driver ends)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *map(str, heads)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return Reaper(proc)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch([int(x) for x in sys.argv[1:]])
