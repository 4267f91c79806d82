"""A watchdog that takes a locally started Ray cluster down with the driver, however it ends.

``ray.init()`` starts the cluster's head processes (gcs_server, raylet, monitors) as children of
the driver; raylet starts the dashboard and runtime-env agents. When the driver is SIGKILLed,
the head processes die with it but the agents are left running under PID 1 (and ignore
SIGTERM). So ``init_ray`` starts this process, before ``ray.init()``, in its own session (a
terminal's Ctrl-C does not reach it) with a pipe from the driver on stdin. It records every new
descendant of the driver while the cluster starts, then (told the head processes' pids on the
pipe) the heads and all their descendants, every 0.5 s at first, then every 5 s. When the pipe
reaches EOF (the driver closed it after ``ray.shutdown()``, or died) it SIGKILLs every recorded
process that is still the same process (pid and start time match), unlinks the shared-memory
weight segments those processes created (``/dev/shm/rl_plugin_weights.<pid>.*``), then exits.

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
# train rank 0's weight segments (rl_plugin.weight_sync.segment: /dev/shm/<prefix>.<pid>.<n>)
WEIGHT_SEGMENTS = ("/dev/shm", "rl_plugin_weights")


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


def watch(driver: int, exclude: List[int]) -> None:
    """Record the driver's new descendants until stdin names the cluster's head processes
    (``heads PID ...``), then the heads' descendants; on EOF kill what is recorded and alive."""
    tracked: Dict[int, int] = {}
    heads: Optional[List[int]] = None
    skip = set(exclude) | {os.getpid()}
    start, pending = time.monotonic(), b""
    while True:
        table = process_table()
        if heads is None:  # ray.init() is running: every new child of the driver is the cluster's
            roots = [p for p, (ppid, _) in table.items() if ppid == driver and p not in skip]
        else:
            roots = list(heads)
        roots += [p for p, t in tracked.items() if p in table and table[p][1] == t]
        tracked.update(descendants(roots, table))
        period = 0.5 if time.monotonic() - start < 60 else 5.0
        ready, _, _ = select.select([sys.stdin], [], [], period)
        if ready:
            data = os.read(sys.stdin.fileno(), 4096)
            if not data:
                break  # EOF: the driver is done or dead
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.startswith(b"heads"):
                    heads = [int(x) for x in line.split()[1:]]
                    tracked = descendants(
                        heads + [p for p in tracked if p not in skip and _is_below(p, heads, table)], table
                    )
    time.sleep(GRACE_S)
    for pid, ticks in tracked.items():
        st = _stat(pid)
        if st is not None and st[1] == ticks:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    remove_weight_segments(tracked)


def remove_weight_segments(pids: Iterable[int]) -> None:
    """Unlink the shared-memory weight segments the given (dead) processes created: a SIGKILLed
    train actor cannot unlink its own."""
    directory, prefix = WEIGHT_SEGMENTS
    for pid in pids:
        for path in Path(directory).glob(f"{prefix}.{int(pid)}.*"):
            try:
                path.unlink()
            except OSError:
                pass


def _is_below(pid: int, roots: List[int], table: Dict[int, tuple]) -> bool:
    return pid in descendants(roots, table)


class Reaper:
    """The driver's end of the pipe: ``set_heads`` after ``ray.init()``, ``stop`` at shutdown
    (closing the pipe, as the driver's death does)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def set_heads(self, heads: List[int]) -> None:
        self.proc.stdin.write(("heads " + " ".join(map(str, heads)) + "\n").encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Close the pipe; the watchdog (its own session) cleans up after ``GRACE_S`` and exits,
        whether or not the driver is still there."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


def start_reaper() -> Optional[Reaper]:
    """Start the watchdog BEFORE ``ray.init()``: a driver killed while the cluster starts up
    must take it down too. The driver's existing children are not its business."""
    if not Path("/proc/self/stat").exists():
        return None
    existing = children(os.getpid())
    # run as a script (stdlib only), so it needs nothing on the path; no stdout/stderr of the
    # driver held open (a pipe reader of the driver's output must see EOF when the driver ends)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(os.getpid()), *map(str, existing)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    return Reaper(proc)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), [int(x) for x in sys.argv[2:]])
