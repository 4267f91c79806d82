"""The errors rl_plugin raises on purpose (``rl_plugin.errors``): ``fail``'s one-line form, the
exit codes the run maps them to, and their hierarchy (what the loop catches as what)."""

from __future__ import annotations

import signal

import pytest

from rl_plugin.errors import (
    EXIT_SIGNALS,
    Interrupted,
    LoopError,
    RLArgumentError,
    Stopped,
    StopRequested,
    WeightSyncError,
    fail,
)


def test_fail_is_flags_rule_fix_in_one_line():
    with pytest.raises(RLArgumentError) as err:
        fail("--eps-clip 0", "the clip range must be > 0", "use e.g. --eps-clip 0.2")
    assert str(err.value) == "--eps-clip 0: the clip range must be > 0. Fix: use e.g. --eps-clip 0.2."
    assert isinstance(err.value, ValueError)  # argparse-style callers catch ValueError


def test_exit_codes_and_fields():
    assert Interrupted("ctrl-c").exit_code == 130 and Interrupted("x", exit_code=143).exit_code == 143
    assert Stopped("saved", 128 + signal.SIGTERM).exit_code == 143
    stuck = StopRequested("cut", stuck=True, steps_done=2)
    assert (stuck.stuck, stuck.steps_done, str(stuck)) == (True, 2, "cut")
    assert (StopRequested("cut").stuck, StopRequested("cut").steps_done) == (False, 0)


def test_the_loop_catches_every_run_error_as_a_loop_error():
    for cls in (WeightSyncError, Interrupted, StopRequested, Stopped):
        assert issubclass(cls, LoopError) and issubclass(cls, RuntimeError)
    assert not issubclass(RLArgumentError, LoopError)
    # a first Ctrl-C asks the run to stop and save, as SIGTERM does (issue 44 item 19)
    assert set(EXIT_SIGNALS) == {signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT}
