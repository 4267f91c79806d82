"""Deadlines on user code (``rl_plugin.rollout.deadlines``): ``SerialWorker`` runs plain ``def``
calls one at a time in submission order, in the caller's context, with a deadline counted from the
call's start; a stuck call is abandoned to a fresh thread; ``call_with_deadline`` awaits or runs in
the worker; ``gather_calls`` stops at the first deadline. A user's own ``TimeoutError`` stays its
own. Deadlines here are 0.2-0.5 s: the stuck calls wait on an event the test sets at its end."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time

import pytest

from rl_plugin.rollout.deadlines import (
    SerialWorker,
    UserCallTimeout,
    call_with_deadline,
    gather_calls,
    is_async_callable,
)

VAR = contextvars.ContextVar("VAR", default="unset")


@pytest.fixture
def release():
    """Set at the end of a test: the calls left stuck in their daemon threads return."""
    ev = threading.Event()
    yield ev
    ev.set()


def test_is_async_callable_sees_through_wrappers_and_call_objects():
    async def a():
        pass

    def p():
        pass

    class AsyncCall:
        async def __call__(self):
            pass

    class PlainCall:
        def __call__(self):
            pass

    @functools.wraps(a)
    def wrapped(*args):
        return a(*args)

    assert is_async_callable(a) and is_async_callable(AsyncCall()) and is_async_callable(wrapped)
    assert not is_async_callable(p) and not is_async_callable(PlainCall())
    assert not is_async_callable(functools.partial(p))


def test_calls_run_one_at_a_time_in_submission_order_in_the_callers_context():
    worker = SerialWorker()
    order, overlap, running = [], [], [0]

    def job(k):
        running[0] += 1
        overlap.append(running[0])
        time.sleep(0.01)
        order.append((k, VAR.get(), threading.current_thread().name))
        running[0] -= 1
        return k * k

    async def main():
        VAR.set("rollout 3")
        return await asyncio.gather(*[worker.acall(job, k, timeout=5, what="--rm-timeout") for k in range(6)])

    assert asyncio.run(main()) == [0, 1, 4, 9, 16, 25]
    assert [k for k, _, _ in order] == list(range(6)) and max(overlap) == 1
    assert {v for _, v, _ in order} == {"rollout 3"} and {t for _, _, t in order} == {"rl_plugin-user-code"}
    assert worker.call(job, 7, timeout=5, what="x") == 49  # the blocking form


def test_a_stuck_call_is_abandoned_and_the_queue_behind_it_is_served(release):
    worker = SerialWorker()
    threads = []

    def stuck():
        threads.append(threading.get_ident())
        release.wait(30)

    def quick(k):
        threads.append(threading.get_ident())
        return k

    async def main():
        first = asyncio.ensure_future(worker.acall(stuck, timeout=0.2, what="--rm-timeout"))
        later = [asyncio.ensure_future(worker.acall(quick, k, timeout=0.5, what="--rm-timeout")) for k in range(3)]
        with pytest.raises(UserCallTimeout, match=r"^did not return within --rm-timeout 0.2 s$"):
            await first
        return await asyncio.gather(*later)

    t0 = time.monotonic()
    assert asyncio.run(main()) == [0, 1, 2]
    assert time.monotonic() - t0 < 3
    assert len(set(threads)) == 2 and threads[1] == threads[2] == threads[3]  # one fresh thread serves the rest


def test_the_deadline_counts_from_the_start_not_from_the_queue():
    worker = SerialWorker()

    def slow(s):
        time.sleep(s)
        return s

    async def main():
        # four 0.2 s calls in a row under a 0.5 s deadline each: the last starts 0.6 s after it was queued
        return await asyncio.gather(*[worker.acall(slow, 0.2, timeout=0.5, what="x") for _ in range(4)])

    assert asyncio.run(main()) == [0.2] * 4


def test_a_functions_own_timeout_error_is_its_own():
    worker = SerialWorker()

    def raises():
        raise TimeoutError("the judge's HTTP call timed out")

    with pytest.raises(TimeoutError) as info:
        worker.call(raises, timeout=5, what="--rm-timeout")
    assert type(info.value) is TimeoutError and str(info.value) == "the judge's HTTP call timed out"

    async def main():
        return await worker.acall(raises, timeout=5, what="--rm-timeout")

    with pytest.raises(TimeoutError) as info:
        asyncio.run(main())
    assert type(info.value) is TimeoutError and str(info.value) == "the judge's HTTP call timed out"


def test_the_blocking_call_times_out_too(release):
    worker = SerialWorker()
    with pytest.raises(UserCallTimeout, match=r"^did not return within --custom-generate-timeout 0.2 s$"):
        worker.call(release.wait, 30, timeout=0.2, what="--custom-generate-timeout")
    assert worker.call(lambda: "next", timeout=5, what="x") == "next"


def test_call_with_deadline_awaits_async_functions_and_awaitables_a_def_returns():
    worker = SerialWorker()

    async def a(x):
        await asyncio.sleep(0)
        return x + 1

    def returns_awaitable(x):
        return a(x)

    async def hangs():
        await asyncio.Event().wait()

    async def main():
        assert await call_with_deadline(a, 1, timeout=5, what="x", worker=worker) == 2
        assert await call_with_deadline(returns_awaitable, 2, timeout=5, what="x", worker=worker) == 3
        assert await call_with_deadline(lambda: 7, timeout=5, what="x", worker=worker) == 7
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UserCallTimeout, match=r"^did not return within --rollout-function-timeout 0.2 s$"):
            await call_with_deadline(hangs, timeout=0.2, what="--rollout-function-timeout", worker=worker)
        assert asyncio.get_running_loop().time() - t0 < 2

        async def own():
            raise asyncio.TimeoutError("mine")

        with pytest.raises(TimeoutError, match="^mine$"):
            await call_with_deadline(own, timeout=5, what="x", worker=worker)

    asyncio.run(main())


def test_gather_calls_keeps_order_and_errors_in_place_and_stops_at_the_first_deadline():
    async def ok(x):
        await asyncio.sleep(0.01 * x)
        return x

    async def bad():
        raise ValueError("reward failed")

    async def forever():
        await asyncio.Event().wait()

    async def late():
        await asyncio.sleep(0.1)
        raise UserCallTimeout("did not return within --rm-timeout 0.1 s")

    async def main():
        out = await gather_calls([ok(2), bad(), ok(1)])
        assert out[0] == 2 and out[2] == 1 and isinstance(out[1], ValueError) and str(out[1]) == "reward failed"
        t0 = asyncio.get_running_loop().time()
        out = await gather_calls([forever(), late(), forever()])
        assert asyncio.get_running_loop().time() - t0 < 2  # not waited out
        assert isinstance(out[0], asyncio.CancelledError) and isinstance(out[2], asyncio.CancelledError)
        assert isinstance(out[1], UserCallTimeout)

    asyncio.run(main())
