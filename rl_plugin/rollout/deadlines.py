"""Deadlines on user code: the generate hook (``--custom-generate-timeout``, per sample), the
rollout function (``--rollout-function-timeout``, per rollout) and a local reward function
(``--rm-timeout``, per call).

- An ``async def`` is awaited under ``asyncio.wait_for``: past its deadline it is cancelled.
- A plain ``def`` runs in a ``SerialWorker``: one daemon thread that runs such calls one at a time,
  in the order they were submitted (as they ran before, on the caller's thread: user code that is
  not thread-safe stays safe), so the caller's deadline can fire while a call is stuck. Its
  deadline counts from the moment the call starts, not from when it was queued. A thread cannot
  be interrupted: a stuck call is left behind in its (daemon) thread and the worker starts a fresh
  thread for later calls; the run stops anyway, naming the function.

A call past its deadline raises ``UserCallTimeout`` (a ``TimeoutError``); the caller re-raises it
naming the flag, the function's file:line and the sample (``generation.hooks``, ``rewards.scorer``).
The calling context's ``contextvars`` travel with a call into the worker (``generate_tokens`` finds
the rollout's router from there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import queue
import threading
from typing import Any, Callable, Optional


class UserCallTimeout(TimeoutError):
    """A user function did not return within its deadline; the message says which deadline."""


def is_async_callable(fn: Callable) -> bool:
    """An ``async def`` function, or a callable object whose ``__call__`` is one."""
    target = inspect.unwrap(fn)
    return inspect.iscoroutinefunction(target) or (
        not inspect.isroutine(target) and inspect.iscoroutinefunction(type(target).__call__)
    )


class _Job:
    __slots__ = ("fn", "call_args", "kwargs", "context", "started", "done")

    def __init__(self, fn, args, kwargs):
        self.fn, self.call_args, self.kwargs = fn, args, kwargs
        self.context = contextvars.copy_context()
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self.done: concurrent.futures.Future = concurrent.futures.Future()


class SerialWorker:
    """Plain-``def`` user calls, one at a time in one daemon thread (module docstring)."""

    def __init__(self, name: str = "rl_plugin-user-code"):
        self.name = name
        self._queue: Optional[queue.SimpleQueue] = None
        self._lock = threading.Lock()

    def _submit(self, fn, args, kwargs) -> _Job:
        job = _Job(fn, args, kwargs)
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._queue,), name=self.name, daemon=True).start()
            self._queue.put(job)
        return job

    def _abandon(self, q: Optional[queue.SimpleQueue]) -> None:
        """The thread serving ``q`` is stuck in a call: later calls go to a fresh thread."""
        with self._lock:
            if self._queue is q:
                self._queue = None

    @staticmethod
    def _serve(q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if not job.started.set_running_or_notify_cancel():
                continue
            job.started.set_result(None)
            if not job.done.set_running_or_notify_cancel():
                continue
            try:
                job.done.set_result(job.context.run(job.fn, *job.call_args, **job.kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as the call's error
                job.done.set_exception(exc)

    def call(self, fn: Callable, *args, timeout: float, what: str, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` in the worker, waited for at most ``timeout`` seconds from its
        start (blocking the calling thread); ``UserCallTimeout`` naming ``what`` past it."""
        q = self._queue
        job = self._submit(fn, args, kwargs)
        job.started.result()
        try:
            return job.done.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if job.done.done():  # the function's own TimeoutError
                raise
            self._abandon(q if q is not None else self._queue)
            raise UserCallTimeout(f"did not return within {what} {timeout:g} s") from None

    async def acall(self, fn: Callable, *args, timeout: float, what: str, **kwargs) -> Any:
        """``call`` from an event loop: the loop (and every other deadline) keeps running."""
        with self._lock:
            q = self._queue
        job = self._submit(fn, args, kwargs)
        await asyncio.wrap_future(job.started)
        try:
            return await asyncio.wait_for(_bridge(job.done), timeout)
        except asyncio.TimeoutError:
            if (
                job.done.done() and not job.done.cancelled() and job.done.exception() is not None
            ):  # the function's own TimeoutError
                raise
            self._abandon(q if q is not None else self._queue)
            raise UserCallTimeout(f"did not return within {what} {timeout:g} s") from None


def _bridge(done: concurrent.futures.Future) -> asyncio.Future:
    """``done`` as an asyncio future of the running loop, its exception passed on as the same object
    (``asyncio.wrap_future`` replaces a ``TimeoutError`` by a new one, losing the user's file:line)."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def copy(_):
        if out.done():
            return
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    def on_done(_):
        try:
            loop.call_soon_threadsafe(copy, None)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    done.add_done_callback(on_done)
    return out


async def call_with_deadline(fn: Callable, *args, timeout: float, what: str, worker: SerialWorker, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` within ``timeout`` seconds: awaited (``async def``) or run in
    ``worker`` (plain ``def``; an awaitable it returns is awaited within the time left). ``what``
    names the deadline's flag for the ``UserCallTimeout`` message."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    if is_async_callable(fn):
        out = fn(*args, **kwargs)
    else:
        out = await worker.acall(fn, *args, timeout=timeout, what=what, **kwargs)
        if not inspect.isawaitable(out):
            return out
    left = max(timeout - (loop.time() - start), 0.0)
    try:
        return await asyncio.wait_for(out, left) if inspect.isawaitable(out) else out
    except asyncio.TimeoutError:
        if loop.time() - start < timeout:  # the function's own TimeoutError, raised before the deadline
            raise
        raise UserCallTimeout(f"did not return within {what} {timeout:g} s") from None
