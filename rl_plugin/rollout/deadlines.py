"""Deadlines on user code: the generate hook (``--custom-generate-timeout``, per sample), the
rollout function (``--rollout-function-timeout``, per rollout) and a local reward function
(``--rm-timeout``, per call).

- An ``async def`` is awaited under ``asyncio.wait_for``: past its deadline it is cancelled.
- A plain ``def`` runs in a ``SerialWorker``: one daemon thread that runs such calls one at a time,
  in the order they were submitted (as they ran before, on the caller's thread: user code that is
  not thread-safe stays safe), so the caller's deadline can fire while a call is stuck. Its
  deadline counts from the moment the call starts, not from when it was queued. A thread cannot
  be interrupted: a stuck call is left behind in its (daemon) thread and a fresh thread serves the
  calls queued behind it and later ones (the queue is the worker's, not the thread's); the run
  stops anyway, naming the function.
- ``gather_calls``: many such calls at once (a reward per sample), stopped at the first deadline
  passed: the calls still queued or running are cancelled, not waited out one by one.

A call past its deadline raises ``UserCallTimeout`` (a ``TimeoutError``); the caller re-raises it
naming the flag, the function's file:line and the sample (``generation.hooks``, ``rewards.scorer``).
The calling context's ``contextvars`` travel with a call into the worker (``generate_tokens`` finds
the rollout's router from there).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import inspect
import threading
from typing import Any, Callable, Deque


class UserCallTimeout(TimeoutError):
    """A user function did not return within its deadline; the message says which deadline."""


def is_async_callable(fn: Callable) -> bool:
    """An ``async def`` function, or a callable object whose ``__call__`` is one."""
    target = inspect.unwrap(fn)
    return inspect.iscoroutinefunction(target) or (
        not inspect.isroutine(target) and inspect.iscoroutinefunction(type(target).__call__)
    )


class _Job:
    __slots__ = ("fn", "call_args", "kwargs", "context", "started", "done", "thread")

    def __init__(self, fn, args, kwargs):
        self.fn, self.call_args, self.kwargs = fn, args, kwargs
        self.context = contextvars.copy_context()
        self.started: concurrent.futures.Future = concurrent.futures.Future()
        self.done: concurrent.futures.Future = concurrent.futures.Future()
        self.thread = -1  # the generation of the thread that took it (``SerialWorker``)


class SerialWorker:
    """Plain-``def`` user calls, one at a time in one daemon thread (module docstring).

    The queued calls are the worker's, not a thread's: one deque under one condition, served by
    the thread of the current *generation*. Abandoning a stuck call (``_abandon``) moves to the
    next generation: the stuck thread exits when (if ever) its call returns, without taking
    another, and a fresh thread serves the calls queued behind it, so their callers (waiting on
    ``job.started``) are served and their own deadlines start."""

    def __init__(self, name: str = "rl_plugin-user-code"):
        self.name = name
        self._cond = threading.Condition()
        self._jobs: Deque[_Job] = collections.deque()
        self._generation = 0  # the generation whose thread serves ``_jobs``
        self._serving = False  # that thread was started

    def _submit(self, fn, args, kwargs) -> _Job:
        job = _Job(fn, args, kwargs)
        with self._cond:
            self._jobs.append(job)
            self._start()
            self._cond.notify()
        return job

    def _start(self) -> None:
        """A thread for the current generation, unless it has one (called under ``_cond``)."""
        if not self._serving:
            self._serving = True
            threading.Thread(target=self._serve, args=(self._generation,), name=self.name, daemon=True).start()

    def _abandon(self, job: _Job) -> None:
        """``job``'s thread is stuck in it: the calls queued behind go to a fresh thread."""
        with self._cond:
            if job.thread != self._generation:  # already abandoned (or never taken)
                return
            self._generation += 1
            self._serving = False
            if self._jobs:
                self._start()
            self._cond.notify_all()

    def _serve(self, generation: int) -> None:
        while True:
            with self._cond:
                while generation == self._generation and not self._jobs:
                    self._cond.wait()
                if generation != self._generation:
                    return  # abandoned: a fresh thread serves the queue
                job = self._jobs.popleft()
                job.thread = generation
            if not job.started.set_running_or_notify_cancel():
                continue  # its caller gave up (cancelled) before it started
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
        job = self._submit(fn, args, kwargs)
        job.started.result()
        try:
            return job.done.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            if job.done.done():  # the function's own TimeoutError
                raise
            self._abandon(job)
            raise UserCallTimeout(f"did not return within {what} {timeout:g} s") from None

    async def acall(self, fn: Callable, *args, timeout: float, what: str, **kwargs) -> Any:
        """``call`` from an event loop: the loop (and every other deadline) keeps running. A
        caller cancelled while its call runs gives the thread up too (nobody waits for it; the
        calls behind it must not wait on it either)."""
        job = self._submit(fn, args, kwargs)
        await asyncio.wrap_future(job.started)  # cancelled here: the job is skipped, never run
        try:
            return await asyncio.wait_for(_bridge(job.done), timeout)
        except asyncio.TimeoutError:
            if (
                job.done.done() and not job.done.cancelled() and job.done.exception() is not None
            ):  # the function's own TimeoutError
                raise
            self._abandon(job)
            raise UserCallTimeout(f"did not return within {what} {timeout:g} s") from None
        except asyncio.CancelledError:
            if not job.done.done():
                self._abandon(job)
            raise


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


async def gather_calls(calls) -> list:
    """The results of ``calls`` (awaitables, run concurrently), in order, an exception in its
    call's place (``gather(return_exceptions=True)``), except that the first ``UserCallTimeout``
    cancels the calls still running or queued: the caller stops at the first deadline instead of
    waiting out every stuck call one worker deadline after another (their places hold the
    ``CancelledError``)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and isinstance(t.exception(), UserCallTimeout) for t in done):
                break
    finally:
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
    return [asyncio.CancelledError() if t.cancelled() else (t.exception() or t.result()) for t in tasks]
