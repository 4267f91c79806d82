"""Aborting a rollout (``rl_plugin.rollout.abort``): ``check`` raises once requested naming the
phase, ``phase`` nests and restores its name, ``request`` returns what runs and cancels the tasks
``run`` started (from another thread), ending them with ``GenerationAborted``.

The request is process-wide and permanent by design (the process is torn down after it), so each
test gets a fresh flag (``monkeypatch``) and leaves the real one unset."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rl_plugin.rollout import abort


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(abort, "_requested", threading.Event())
    monkeypatch.setattr(abort, "_running", {})
    monkeypatch.setattr(abort, "_phase", None)


def test_check_passes_until_requested_then_names_the_phase():
    abort.check()
    assert not abort.requested()
    assert abort.request() is None  # nothing was running
    assert abort.requested()
    with pytest.raises(abort.GenerationAborted, match=r"^aborted on request during the rollout$"):
        abort.check()


def test_phases_nest_and_request_reports_the_innermost():
    seen = []
    with abort.phase("the reward"):
        with abort.phase("the engine"):
            seen.append(abort._phase)
        seen.append(abort._phase)
        assert abort.request() == "the reward"
        with pytest.raises(abort.GenerationAborted, match="during the reward"):
            abort.check()
    assert seen == ["the engine", "the reward"] and abort._phase is None
    with pytest.raises(abort.GenerationAborted, match="during the hook"):
        with abort.phase("the hook"):  # entering a phase after the request refuses at once
            pytest.fail("the body ran after the abort")


def test_run_returns_the_result_and_restores_the_phase():
    async def work():
        assert abort._phase == "the hooks"
        await asyncio.sleep(0)
        return 42

    assert abort.run(work(), "the hooks") == 42
    assert abort._phase is None and not abort._running


def test_a_request_from_another_thread_cancels_a_task_awaiting_forever():
    started = threading.Event()
    answer = {}

    async def stuck():
        started.set()
        await asyncio.Event().wait()  # a tool that never answers

    def requester():
        started.wait(10)
        answer["phase"] = abort.request()

    t = threading.Thread(target=requester)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(abort.GenerationAborted, match=r"^aborted on request during the generate hooks$"):
        abort.run(stuck(), "the generate hooks")
    t.join(10)
    assert time.monotonic() - t0 < 5
    assert answer["phase"] == "the generate hooks"
    assert not abort._running


def test_run_after_a_request_never_starts_the_coroutine():
    """Regression: ``phase`` raised before the ``finally`` that closes the coroutine was entered,
    so an abort requested before the call left it unawaited (a RuntimeWarning)."""
    ran = []

    async def body():
        ran.append(1)

    abort.request()
    coro = body()
    with pytest.raises(abort.GenerationAborted, match="during the reward"):
        abort.run(coro, "the reward")
    assert ran == [] and coro.cr_frame is None  # closed, not left pending


def test_a_cancellation_without_a_request_stays_a_cancellation():
    async def cancelled():
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        abort.run(cancelled(), "the reward")
    assert not abort.requested()


def test_a_running_task_is_named_even_when_another_thread_left_its_phase():
    """``_phase`` is module-wide: a thread leaving its own ``phase`` restores its earlier name while
    this task runs (seen in the full suite: ``request`` returned None). The running task's own
    name is what ``request`` reports."""
    started = threading.Event()
    answer = {}

    async def stuck():
        started.set()
        await asyncio.Event().wait()

    def requester():
        started.wait(10)
        abort._phase = None  # what another thread's `with phase(...)` exit does to the global
        answer["phase"] = abort.request()

    t = threading.Thread(target=requester)
    t.start()
    with pytest.raises(abort.GenerationAborted):
        abort.run(stuck(), "the generate hooks")
    t.join(10)
    assert answer["phase"] == "the generate hooks"
