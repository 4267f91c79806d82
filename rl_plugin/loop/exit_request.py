"""Stopping a run on purpose: exit signals and a wall-time budget (Megatron-LM's flags).

``--exit-signal-handler`` (default on): SIGTERM (what Slurm and Kubernetes send on preemption),
SIGUSR1 (Slurm's ``--signal`` default), SIGHUP and SIGINT (Ctrl-C) set a request. They are blocked
in the driver's threads (``take_exit_signals``, first thing in ``rl-plugin-train``: every thread
started after inherits the mask, torch's and Ray's included) and taken by one thread of ours
(``sigwait``): Ray's core worker resets SIGTERM's disposition to the default in the C library
during ``ray.shutdown()``, and a SIGTERM that reached a thread then killed the driver mid-teardown
(the lock left, no reward curve). The handler only records the request (it never raises: a
handler that raised inside Ray's waits, whose C code lets only KeyboardInterrupt through, ended in
``SystemError``). The run acts on it where it waits:

- every wait of the driver (``TrainGroup``, ``RolloutClient``) polls ``poll`` every
  ``POLL_S`` instead of blocking in ``ray.get``. The first poll after the signal runs the
  ``actions`` once, none of which waits for an answer: the train ranks are asked to stop before
  their next optimizer step first, then the rollout manager to abort its generation (engines
  between two decode steps, the hooks' and rewards' asyncio tasks cancelled); what the manager was
  running is read when a message needs it (a manager that does not answer costs the exit nothing).
  A generate or eval that has not answered ``GIVE_UP * grace`` after the signal is given up
  (``StopRequested``: a sync user function that never returns cannot be interrupted); the rest of
  the grace is for the checkpoint and the teardown.
- the run then writes the checkpoint of the last complete rollout (``--save``) and exits with
  128 + the signal (``loop/run.py``; Ctrl-C: 130).
- a watchdog thread makes sure of the deadline: a run still alive ``--exit-signal-grace-s`` after
  the first signal prints what was running, releases the output lock and ends at once
  (``os._exit``: the local cluster goes with the driver, ``rl_plugin.ray.reaper``); a save cut
  short leaves only a ``.partial``, never loaded, so the last complete checkpoint stays the
  resume point.
- a second signal ends the run at once the same way (the resume line, the lock released). The same
  signal again within ``REPEAT_WINDOW_S`` of the first is a copy of the first request, not a
  second one (``rl_plugin.errors``: GNU ``timeout``, Slurm and Kubernetes deliver one request twice).

``--no-exit-signal-handler``: the signals keep their own actions during the run (SIGTERM ends the
process; Ctrl-C raises KeyboardInterrupt, which ends the run at once, unsaved).

``--exit-duration-in-mins M``: once M minutes have passed since the run started, the loop saves
and stops the same way between two rollouts, and exits 0 (as Megatron-LM does), so a job chain
can resume it with the printed command.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Union

from rl_plugin.errors import EXIT_SIGNALS, REPEAT_WINDOW_S, StopRequested

POLL_S = 0.2  # how often a wait of the driver looks at the request

_route: Dict[str, Optional[Callable[[int], None]]] = {"to": None}  # who takes the next exit signal
_taker: List[threading.Thread] = []


def take_exit_signals(to: Optional[Callable[[int], None]]) -> Optional[Callable[[int], None]]:
    """Route the exit signals to ``to`` (None: the process's own handlers again); returns the
    route before. A route blocks them in the calling thread (call it before any thread starts:
    the main thread, first; again after a None route unblocked them there); the first starts the
    one thread that takes them."""
    before, _route["to"] = _route["to"], to
    if to is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, EXIT_SIGNALS)
        if not _taker:
            _taker.append(threading.Thread(target=_take, name="rl_plugin-exit-signals", daemon=True))
            _taker[0].start()
    elif _taker and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, EXIT_SIGNALS)  # the main thread's own handlers again
    return before


def _take() -> None:
    while True:
        signum = signal.sigwait(EXIT_SIGNALS)
        to = _route["to"]
        if to is None:  # no route: the main thread (unblocked again) runs the process's handler
            os.kill(os.getpid(), signum)
            time.sleep(0.05)
        else:
            to(signum)


GIVE_UP = 0.25  # of the grace: an aborted generate has answered by then (one decode step, a cancelled task)


class ExitRequest:
    def __init__(self, *, handle_signals: bool, duration_mins: Optional[float], will_save: bool, grace_s: float = 20.0):
        self.handle_signals = handle_signals
        self.deadline = None if duration_mins is None else time.monotonic() + 60.0 * duration_mins
        self.duration_mins = duration_mins
        self.will_save = will_save
        self.grace_s = grace_s
        self.signum: Optional[int] = None
        self.signalled_at: Optional[float] = None
        # what the run asks of its actors at the first poll after the signal (stop, abort), in order;
        # none may wait for an answer. Each may return what was running then (the rollout manager's
        # phase, which the messages name), or a function that reads it later (None: not known yet)
        self.actions: List[Callable[[], Union[None, str, Callable[[], Optional[str]]]]] = []
        self._running: List[Union[str, Callable[[], Optional[str]]]] = []
        # the run's last words on an exit at once: the resume line, and the lock to release
        self.resume_hint: Callable[[], str] = lambda: ""
        self.release_lock: Callable[[], None] = lambda: None
        self.finished = False  # the run's rollouts are all done: a signal now only ends the teardown
        self._acted = False
        self._previous: Dict[int, object] = {}
        self._watchdog: Optional[threading.Thread] = None
        self._cancel = threading.Event()
        self._route_before: Optional[Callable[[int], None]] = None
        self._routed = False

    def install(self) -> None:
        """Take over the exit signals (again after ``ray.init``, which sets its own SIGTERM handler).
        ``--no-exit-signal-handler``: the signals' own actions for the run (SIGTERM ends the
        process, Ctrl-C raises KeyboardInterrupt), not the start-up's exit."""
        if not self.handle_signals:
            if not self._routed:
                self._route_before, self._routed = take_exit_signals(None), True
            return
        for sig in EXIT_SIGNALS:  # a thread started before install (if any) still runs the handler
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        if not self._routed:
            self._route_before, self._routed = take_exit_signals(lambda signum: self._handle(signum, None)), True

    def restore(self) -> None:
        self._cancel.set()  # the run is over: no watchdog exit
        if self._routed:
            take_exit_signals(self._route_before)
            self._routed = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    # -- the handler (the signal thread, or the main thread between two bytecodes: never raises) ---
    def _handle(self, signum: int, frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.signum is not None:
            if signum == self.signum and now - self.signalled_at < REPEAT_WINDOW_S:
                return  # a copy of the first request (REPEAT_WINDOW_S), not a second signal
            self._exit_now(128 + signum, f"aborted by a second signal ({name})")
            return  # (never reached: the process has ended)
        self.signum, self.signalled_at = signum, now
        if self.finished:
            then = "the run has finished: completing its teardown"
        elif self.will_save:
            then = "stopping the rollout in progress, writing the last complete one's checkpoint, then exiting"
        else:
            then = "stopping the rollout in progress, then exiting (no --save: nothing is written)"
        _say(
            f"\nreceived {name}: {then} within --exit-signal-grace-s {self.grace_s:g} s; a second signal "
            f"(over {REPEAT_WINDOW_S:g} s later) aborts at once\n"
        )
        self._watchdog = threading.Thread(target=self._watch, name="rl_plugin-exit-grace", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        if self._cancel.wait(self.grace_s):
            return
        running = self.running()
        what = f" (running: {'; '.join(running)})" if running else ""
        self._exit_now(
            128 + self.signum,
            f"the run did not stop within --exit-signal-grace-s {self.grace_s:g} s after "
            f"{signal.Signals(self.signum).name}{what}; exiting now, the last complete checkpoint is the resume point",
        )

    def _exit_now(self, code: int, why: str) -> None:
        """End the process now: ``why``, the resume line, the lock released (the watchdog's and
        the second signal's way out; the local Ray cluster goes with the driver)."""
        try:
            hint = self.resume_hint()
        except Exception as exc:  # noqa: BLE001 - the exit must not fail on its message
            hint = f"(the resume command could not be computed: {exc})"
        _say(f"\n{why}. {hint}\n")
        try:
            self.release_lock()
        finally:
            os._exit(code)

    # -- what the run reads ---------------------------------------------------------------------
    def poll(self, can_abandon: bool = False) -> None:
        """Called by the driver's waits every ``POLL_S``: the first call after a signal runs the
        ``actions``; with ``can_abandon`` (a generate or an eval, whose result the run can do
        without), a call still running ``GIVE_UP * grace`` after the signal is given up."""
        if self.signum is None or self.finished:
            return
        if not self._acted:
            self._acted = True
            for action in self.actions:
                try:
                    what = action()
                except Exception as exc:  # noqa: BLE001 - an actor that cannot be told: the deadline still holds
                    what = f"(an abort request failed: {exc})"
                if what:
                    self._running.append(what)
        if can_abandon and time.monotonic() >= self.signalled_at + GIVE_UP * self.grace_s:
            running = "; ".join(self.running()) or "the rollout"
            raise StopRequested(
                f"the rollout manager did not answer the abort within {GIVE_UP * self.grace_s:g} s "
                f"({GIVE_UP:g} x --exit-signal-grace-s): stuck in {running}",
                stuck=True,
            )

    def running(self) -> List[str]:
        """What the actions' answers say was running when the signal came (those in so far)."""
        out = []
        for what in self._running:
            if callable(what):
                try:
                    what = what()
                except Exception:  # noqa: BLE001 - a message must not fail on an actor's answer
                    what = None
            if what:
                out.append(what)
        return out

    def reason(self) -> Optional[str]:
        """Why the loop must stop now (None: go on)."""
        if self.signum is not None:
            return f"stopped by {signal.Signals(self.signum).name}"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"stopped after --exit-duration-in-mins {self.duration_mins:g}"
        return None

    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0


def _say(text: str) -> None:
    """Straight to stderr's file descriptor: a handler may run while the main thread is inside a
    write to ``sys.stderr`` (a reentrant buffered write would raise)."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass
