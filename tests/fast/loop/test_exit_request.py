"""The exit request's signal rules in this process (``rl_plugin.loop.exit_request``; the real runs:
``tests/fast/cli/test_exit_signal_copies.py`` and ``test_exit_signals*.py``).

Issue 44 #18: the same signal twice within ``REPEAT_WINDOW_S`` is one request (GNU ``timeout``,
Slurm and Kubernetes deliver one request as two copies); after the window, or another signal, it
is a second request and ends the process at once. #19: Ctrl-C is an exit signal (saved, 130).
#12: the actions run in order without waiting; what was running is read when asked.
The exit at once (``_exit_now``, ``os._exit``) is recorded here instead of ending pytest.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rl_plugin.errors import EXIT_SIGNALS, REPEAT_WINDOW_S
from rl_plugin.loop.exit_request import ExitRequest, take_exit_signals


@pytest.fixture
def req():
    r = ExitRequest(handle_signals=True, duration_mins=None, will_save=True, grace_s=600)
    r.exits = []
    r._exit_now = lambda code, why: r.exits.append((code, why))  # instead of os._exit
    r.install()
    try:
        yield r
    finally:
        r.restore()  # also cancels the grace watchdog


def _signal(sig, settle: float = 0.1) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(settle)  # the signal thread takes it


def test_a_copy_within_the_window_is_the_same_request(req):
    _signal(signal.SIGUSR1, settle=0.05)
    _signal(signal.SIGUSR1, settle=0.05)  # well within REPEAT_WINDOW_S: GNU timeout's copy
    assert req.reason() == "stopped by SIGUSR1" and req.exits == []


def test_the_same_signal_after_the_window_aborts_at_once(req):
    _signal(signal.SIGUSR1)
    time.sleep(REPEAT_WINDOW_S)
    _signal(signal.SIGUSR1)
    assert req.exits == [(128 + signal.SIGUSR1, "aborted by a second signal (SIGUSR1)")]


def test_another_signal_within_the_window_aborts_at_once(req):
    _signal(signal.SIGUSR1, settle=0.05)
    _signal(signal.SIGHUP, settle=0.05)
    assert req.exits == [(128 + signal.SIGHUP, "aborted by a second signal (SIGHUP)")]


def test_ctrl_c_is_a_request_to_save_and_stop_with_130(req):
    assert signal.SIGINT in EXIT_SIGNALS
    _signal(signal.SIGINT)  # no KeyboardInterrupt: the request is recorded
    assert req.reason() == "stopped by SIGINT" and req.exit_code() == 130 and req.exits == []


def test_the_actions_run_in_order_and_what_was_running_is_read_when_asked(req):
    order, answer = [], {"what": None}
    req.actions = [
        lambda: order.append("stop the ranks"),
        lambda: order.append("abort") or (lambda: answer["what"]),  # fire and forget: answered later
    ]
    _signal(signal.SIGUSR1)
    req.poll()
    assert order == ["stop the ranks", "abort"] and req.running() == []
    answer["what"] = "the generate hook in the rollout manager"
    assert req.running() == ["the generate hook in the rollout manager"]
    req.poll()
    assert order == ["stop the ranks", "abort"]  # once


def test_without_the_handler_the_signals_keep_their_own_actions():
    """``--no-exit-signal-handler``: a signal during the run reaches the process's own handler
    (default: SIGTERM ends it, Ctrl-C raises KeyboardInterrupt), not the start-up's exit, which
    printed "before training started" and left the output lock."""
    started = []
    own = []
    before_route = take_exit_signals(started.append)  # what rl-plugin-train's main routes at start-up
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, EXIT_SIGNALS)  # as main's first call leaves them
    before_handler = signal.signal(signal.SIGUSR1, lambda s, f: own.append(s))
    r = ExitRequest(handle_signals=False, duration_mins=None, will_save=True)
    try:
        r.install()
        _signal(signal.SIGUSR1, settle=0.3)
    finally:
        r.restore()
        take_exit_signals(before_route)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGUSR1, before_handler)
    assert own == [signal.SIGUSR1] and started == [] and r.reason() is None
