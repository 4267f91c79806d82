"""The colocation phases as they happen, for tests: a recording hook, not a mock.

With ``--colocate`` the engines and the training ranks time-share the devices, so the order of the
phases is the contract: per rollout, the trainer offloads (``--offload-train``) before the engines
wake, the engines load the new weights and generate, then sleep, and the trainer reloads before
its first forward. Each party calls ``record(event)`` where a phase happens; with
``RL_PLUGIN_COLOCATION_TRACE=<file>`` set (forwarded to every actor) the event is appended there as
one line (``O_APPEND``: the lines of several processes never interleave), so a test reads the
sequence the real run took. Unset (always, outside tests), it costs one ``os.environ`` lookup.
"""

from __future__ import annotations

import os

TRACE_ENV = "RL_PLUGIN_COLOCATION_TRACE"


def record(event: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{event}\n".encode())
        finally:
            os.close(fd)
