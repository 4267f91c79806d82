"""rl_plugin.flags: a config field is its flag (one default), and the parser is generated from it."""

import argparse
from dataclasses import dataclass, fields

import pytest

from rl_plugin.errors import RLArgumentError
from rl_plugin.flags import (
    Bounds,
    Declared,
    check_bounds,
    declared_flags,
    derived,
    flag,
    flag_of,
    nested,
    option,
    runtime,
    same_as,
)


@dataclass(frozen=True)
class Inner(Declared):
    width: int = flag("--width", type=int, default=3, help="w", group="g", bounds=Bounds(1, "--width 3"))
    fast: bool = flag("--fast", "--quick", action="store_true", help="f", group="g")


@dataclass(frozen=True)
class Outer(Declared):
    inner: Inner = nested(Inner)
    width_again: int = same_as(Inner, "width")
    twice: int = derived(lambda args: 2 * args.width, default=6)
    state: object = None  # runtime, passed by hand


def _parser():
    p = argparse.ArgumentParser()
    for _, spec in declared_flags(Inner):
        p.add_argument(*spec.names, **spec.argparse_kwargs())
    return p


def test_the_field_default_is_the_flag_default():
    args = _parser().parse_args([])
    assert Outer.from_args(args) == Outer()
    assert [f.default for f in fields(Inner)] == [3, False]


def test_from_args_reads_flags_aliases_same_as_derived_and_nested():
    args = _parser().parse_args(["--width", "5", "--quick"])
    cfg = Outer.from_args(args, state="x")
    assert cfg == Outer(inner=Inner(width=5, fast=True), width_again=5, twice=10, state="x")


def test_bounds_name_the_flag_the_range_and_a_fix():
    cfg = Inner.from_args(_parser().parse_args(["--width", "0"]))
    with pytest.raises(RLArgumentError, match=r"--width.*must be >= 1 \(got 0\).*--width 3"):
        check_bounds(cfg)
    check_bounds(Inner())  # the default holds its range


def test_a_flag_needs_dashes():
    with pytest.raises(ValueError):
        flag("width", help="w", group="g")


@dataclass(frozen=True)
class Resolved(Declared):
    """A value resolved from two input flags it declares, and runtime state."""

    mode: str = derived(
        lambda args: args.mode or ("b" if args.legacy_b else "a"),
        "a",
        inputs=[
            option("--mode", choices=["a", "b"], default=None, help="m", group="g"),
            option("--legacy-b", action="store_true", help="l", group="g"),
        ],
    )
    loaded: object = runtime()


def test_a_derived_field_declares_its_inputs():
    assert [spec.names[0] for _, spec in declared_flags(Resolved)] == ["--mode", "--legacy-b"]
    p = argparse.ArgumentParser()
    for _, spec in declared_flags(Resolved):
        p.add_argument(*spec.names, **spec.argparse_kwargs())
    assert Resolved.from_args(p.parse_args([])) == Resolved()
    assert Resolved.from_args(p.parse_args(["--legacy-b"]), loaded=1) == Resolved(mode="b", loaded=1)
    assert flag_of(Resolved, "legacy_b").names == ("--legacy-b",)  # same_as may name an input by its dest
