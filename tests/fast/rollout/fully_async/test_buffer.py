"""The fully-async buffer (``rl_plugin.rollout.fully_async.buffer``): staleness = version - the
oldest token version, groups staler than the bound dropped (``retry``: their prompts re-queued),
FIFO order, ``put`` waiting while full and ``offer`` never, ``close`` releasing every waiter, the
metrics counted since the last call."""

from __future__ import annotations

import threading
import time

import pytest

from rl_plugin.rollout.fully_async.buffer import AsyncBuffer, BufferClosed, Group


def _group(oldest: int, record="r") -> Group:
    return Group(samples=[], rewards=[], record=record, oldest_version=oldest, partial=0)


def test_buffer_drops_groups_staler_than_the_bound_and_retry_requeues_their_prompts():
    requeued = []
    buf = AsyncBuffer(capacity=4, max_staleness=1, handler="retry", requeue=requeued.append)
    for v, rec in [(0, "a"), (1, "b"), (2, "c")]:
        assert buf.put(_group(v, rec))
    got = buf.get(version=2)  # a is 2 behind: dropped and re-queued; b is 1 behind: taken
    assert got.record == "b" and requeued == ["a"]
    assert buf.metrics() == {"async/buffer_groups": 1.0, "async/dropped_stale": 1.0}
    assert buf.metrics()["async/dropped_stale"] == 0.0  # counted since the last call
    drop = AsyncBuffer(capacity=2, max_staleness=0, handler="drop", requeue=requeued.append)
    drop.put(_group(0))
    assert drop.get(version=1, timeout=0.05) is None and requeued == ["a"]


def test_buffer_put_waits_while_full_and_offer_never_does():
    buf = AsyncBuffer(capacity=1, max_staleness=5)
    assert buf.put(_group(0, "x")) and not buf.offer(_group(0, "y"))
    t = threading.Thread(target=lambda: buf.put(_group(0, "z")))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # blocked: full
    assert buf.get(0).record == "x"
    t.join(2)
    assert not t.is_alive() and buf.records() == ["z"]


def test_staleness_is_the_version_minus_the_oldest_token_version():
    assert _group(3).staleness(7) == 4
    assert _group(5).staleness(5) == 0


def test_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match=r"^buffer capacity must be >= 1 group \(got 0\)$"):
        AsyncBuffer(capacity=0, max_staleness=1)


def test_groups_come_out_in_the_order_they_were_put_and_drops_are_counted():
    requeued = []
    buf = AsyncBuffer(capacity=8, max_staleness=2, handler="retry", requeue=requeued.append)
    for rec, v in [("a", 4), ("b", 1), ("c", 3), ("d", 0), ("e", 5)]:
        assert buf.offer(_group(v, rec))
    assert buf.records() == ["a", "b", "c", "d", "e"] and len(buf) == 5
    # at version 5: a (1 behind) taken; b (4 behind) dropped, c (2 behind) taken; d dropped, e taken
    assert [buf.get(5).record for _ in range(3)] == ["a", "c", "e"]
    assert requeued == ["b", "d"]
    assert (buf.put_total, buf.dropped_total) == (5, 2)
    assert buf.metrics() == {"async/buffer_groups": 0.0, "async/dropped_stale": 2.0}
    assert buf.dropped_total == 2  # the total is not reset by metrics()


def test_drop_without_a_requeue_callback_only_counts():
    buf = AsyncBuffer(capacity=2, max_staleness=0, handler="retry", requeue=None)
    buf.put(_group(0))
    assert buf.get(version=3, timeout=0.01) is None
    assert buf.dropped_total == 1 and len(buf) == 0


def test_get_waits_for_a_put_from_another_thread():
    buf = AsyncBuffer(capacity=1, max_staleness=0)
    threading.Timer(0.1, lambda: buf.put(_group(2, "late"))).start()
    t0 = time.monotonic()
    assert buf.get(version=2, timeout=5).record == "late"
    assert 0.05 < time.monotonic() - t0 < 4


def test_close_releases_waiters_and_refuses_new_groups():
    buf = AsyncBuffer(capacity=1, max_staleness=0)
    errors, puts = [], []

    def getter():
        try:
            buf.get(version=10)
        except BufferClosed as exc:
            errors.append(str(exc))

    assert buf.put(_group(5, "stale"))  # 5 behind version 10
    blocked_put = threading.Thread(target=lambda: puts.append(buf.put(_group(0, "late"))))
    blocked_put.start()
    time.sleep(0.1)
    assert blocked_put.is_alive()  # full
    buf.close()
    blocked_put.join(2)
    assert puts == [False]
    g = threading.Thread(target=getter)
    g.start()
    g.join(2)  # the stale group is dropped on the way, then the closed buffer raises
    assert not g.is_alive() and errors == ["the fully-async buffer was closed"]
    assert not buf.put(_group(0)) and not buf.offer(_group(0))


def test_a_shared_lock_is_the_buffers_lock():
    lock = threading.RLock()
    buf = AsyncBuffer(capacity=1, max_staleness=0, lock=lock)
    got = []
    with lock:  # the producer holds it: a put from another thread waits
        t = threading.Thread(target=lambda: got.append(buf.offer(_group(0))))
        t.start()
        t.join(0.2)
        assert t.is_alive() and got == []
    t.join(2)
    assert got == [True]
