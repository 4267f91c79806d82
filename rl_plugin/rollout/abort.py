"""Aborting a rollout in progress: the process-wide request an exit signal ends in.

The run asks the rollout manager (and each engine actor) to ``abort`` from another thread than
the one generating: their Ray actors have a ``control`` concurrency group for it
(``rl_plugin.ray.rollout_actor``). ``request()`` then

- sets the flag the ``hf`` sampler reads between two decode steps (``check``), so a generation
  ends within one forward pass;
- cancels the asyncio tasks started by ``run`` (the user's generate hooks, a rollout function,
  an async reward), so a hook awaiting a tool that never answers ends at once;
- returns what was running (``phase``: the hook, the reward, the engine), for the run's message.

A synchronous user function that never returns (``time.sleep`` in a reward) cannot be interrupted
from Python: the run names it and stops without it (the actor is killed at the teardown). Once
requested, the abort stays: the process is about to be torn down.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Awaitable, Dict, Iterator, Optional, Tuple

_requested = threading.Event()
_lock = threading.Lock()
# each task ``run`` started, with its name: what ``request`` reports having cancelled
_running: Dict[Tuple[asyncio.AbstractEventLoop, "asyncio.Task[Any]"], str] = {}
_phase: Optional[str] = None


class GenerationAborted(RuntimeError):
    """The rollout was aborted on request (an exit signal); nothing it produced is kept."""


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    """Raise ``GenerationAborted`` once an abort was requested (between two units of work)."""
    if _requested.is_set():
        raise GenerationAborted(f"aborted on request during {_phase or 'the rollout'}")


def request() -> Optional[str]:
    """Abort what runs now (module docstring); returns what was running (None: nothing): the
    innermost ``phase``, else the name of a task ``run`` started (``_phase`` is module-wide: another
    thread leaving its own ``phase`` may have reset it while the task runs)."""
    _requested.set()
    with _lock:
        running = list(_running.items())
    for (loop, task), _ in running:
        loop.call_soon_threadsafe(task.cancel)
    return _phase or (running[0][1] if running else None)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Name what runs inside (``request`` reports it); the outer name comes back after."""
    global _phase
    before, _phase = _phase, what
    try:
        check()
        yield
    finally:
        _phase = before


def run(coro: Awaitable[Any], what: str) -> Any:
    """``asyncio.run(coro)``, named ``what`` and cancelled by ``request``: then raises
    ``GenerationAborted`` instead of the ``CancelledError``."""

    async def main():
        key = (asyncio.get_running_loop(), asyncio.current_task())
        with _lock:
            _running[key] = what
        try:
            check()  # requested before the loop started: cancel_threadsafe would have missed it
            return await coro
        except asyncio.CancelledError:
            if _requested.is_set():
                raise GenerationAborted(f"aborted on request during {what}") from None
            raise
        finally:
            with _lock:
                _running.pop(key, None)

    try:
        with phase(what):  # raises at once when an abort was requested before this call
            return asyncio.run(main())
    finally:
        if asyncio.iscoroutine(coro):
            coro.close()  # never awaited when aborted before it started: no "never awaited" warning
