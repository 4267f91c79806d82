"""Server processes an engine starts die with it (Linux ``PR_SET_PDEATHSIG``).

An engine actor that starts a server (SGLang) and is then SIGKILLed (an OOM kill, ``ray.kill``, a
lost node's teardown) never runs its ``close``: the server would be re-parented to init and keep
its port and GPU memory. ``popen_dying_with_parent`` asks the kernel to SIGKILL the child when the
thread that started it ends; engines start their servers from the actor's main thread, which
lives as long as the actor. Elsewhere than Linux it is a plain ``Popen``.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from typing import Sequence

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def popen_dying_with_parent(cmd: Sequence[str], **kwargs) -> subprocess.Popen:
    if sys.platform.startswith("linux"):
        kwargs.setdefault("preexec_fn", _die_with_parent)
    return subprocess.Popen(list(cmd), **kwargs)
