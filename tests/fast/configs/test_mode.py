"""The run's mode (``rl_plugin.configs.mode``): ``Mode.of`` for every combination of the three flags
that decide it, each mode's traits, and the mode the parsed command line yields."""

from __future__ import annotations

import itertools

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.mode import SFT_LOSS, Mode, generates_ahead


def _expected(loss_type, staleness, fully_async):
    """The rule of the module docstring, written out independently: SFT wins, then --fully-async,
    then a staleness > 0 is overlapped, else sync."""
    if loss_type == "sft_loss":
        return Mode.SFT
    if fully_async:
        return Mode.FULLY_ASYNC
    if staleness is not None and staleness >= 1:
        return Mode.OVERLAPPED
    return Mode.SYNC


COMBINATIONS = list(itertools.product(["policy_loss", "sft_loss", "custom_loss"], [None, 0, 1, 2, 5], [False, True]))


@pytest.mark.parametrize("loss_type, staleness, fully_async", COMBINATIONS, ids=str)
def test_of_every_combination(loss_type, staleness, fully_async):
    assert Mode.of(loss_type, staleness, fully_async) is _expected(loss_type, staleness, fully_async)


def test_sft_loss_constant_is_the_flag_value():
    assert SFT_LOSS == "sft_loss"
    assert Mode.of(SFT_LOSS, 1, True) is Mode.SFT


@pytest.mark.parametrize("staleness, ahead", [(None, False), (0, False), (-1, False), (1, True), (3, True)])
def test_generates_ahead(staleness, ahead):
    assert generates_ahead(staleness) is ahead


TRAITS = {
    # mode: (name, generates, generates_ahead, trains_nll, source)
    Mode.SYNC: ("sync", True, False, False, "generation"),
    Mode.OVERLAPPED: ("overlapped", True, True, False, "generation"),
    Mode.FULLY_ASYNC: ("fully_async", True, True, False, "fully_async"),
    Mode.SFT: ("sft", False, False, True, "sft"),
}


@pytest.mark.parametrize("mode", list(Mode), ids=str)
def test_traits(mode):
    assert (str(mode), mode.generates, mode.generates_ahead, mode.trains_nll, mode.source) == TRAITS[mode]


def test_four_distinct_modes():
    assert len(Mode) == 4 and len({m.value for m in Mode}) == 4


@pytest.mark.parametrize(
    "flags, mode",
    [
        ("", Mode.SYNC),
        ("--max-weight-staleness 0", Mode.SYNC),
        ("--max-weight-staleness 1", Mode.OVERLAPPED),
        ("--fully-async --max-weight-staleness 2", Mode.FULLY_ASYNC),
        ("--loss-type sft_loss", Mode.SFT),
    ],
)
def test_of_flags_reads_the_parsed_command_line(flags, mode):
    assert Mode.of_flags(parse_args(flags.split())) is mode
