"""Each setting declared once: a typed config's dataclass field carries its command-line flag.

A config (``rl_plugin.configs``, ``rl_plugin.loss.LossConfig``, ...) is a frozen dataclass whose
fields are declared with one of:

- ``flag("--name", "--alias", default=..., help=..., group=..., bounds=Bounds(...))``: the field IS the flag. Its name(s)
  (the first is ours; slime / Megatron-LM spellings follow), its one default (the field's default,
  which is also argparse's), help text, ``choices`` (a sequence, or a callable read when the parser
  is built: a registry's ``names``), ``type`` / ``action`` / ``nargs`` / ``metavar``, the ``unit`` it
  counts in, and ``megatron=True`` for Megatron-LM's own flags (defined by our parser only when
  Megatron-LM's is absent; ``**MEGATRON`` also puts them in its section). ``group`` is the ``--help`` section (``rl_plugin.arguments.GROUPS``).
- ``same_as(Config, "field")``: a field that reads a flag declared on another config (one default:
  the declaring field's).
- ``derived(fn, default, inputs=(option(...), ...))``: a value computed from the parsed flags
  (``fn(args)``), e.g. a mode resolved from two flags; ``inputs`` declares the flags it is computed
  from that no field holds as given (``option`` takes ``flag``'s arguments).
- ``nested(Config)``: a config inside a config, built from the same flags.
- ``runtime(default)``: state that is no flag (set by hand when the config is built).

``from_args(Config, args)`` builds any config from a parsed namespace (ours, or Megatron-LM's with
``add_rl_arguments`` as its ``extra_args_provider``); ``declared_flags(Config)`` lists the flags a
config declares, which ``rl_plugin.arguments`` adds to its parser. So a new flag is one field, plus
its rule (a method of the config) and its test.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

SPEC = "rl_plugin.flag"  # the key of a field's metadata holding its spec

# The marker of Megatron-LM's own flags (``flag(..., **MEGATRON)``): declared on our configs, added to
# our parser only when Megatron-LM's is absent (as its ``extra_args_provider`` we read its values).
MEGATRON = dict(group="megatron", megatron=True)


@dataclass(frozen=True)
class Bounds:
    """A flag's allowed range: ``low <= x`` (``low < x`` when ``low_open``) and ``x < high``;
    ``example`` is the fix a message suggests."""

    low: float
    example: str
    low_open: bool = False
    high: Optional[float] = None

    def holds(self, value) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value < self.high)

    def describe(self) -> str:
        if self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low}, {self.high})"
        return f"> {self.low}" if self.low_open else f">= {self.low}"


@dataclass(frozen=True)
class Flag:
    """One command-line flag: argparse's ``add_argument(*names, **argparse_kwargs())``."""

    names: Tuple[str, ...]
    help: str
    group: str
    default: Any = None
    type: Optional[Callable[[str], Any]] = None
    choices: Union[None, Sequence[Any], Callable[[], Sequence[Any]]] = None
    action: Optional[str] = None
    nargs: Optional[Union[int, str]] = None
    metavar: Optional[str] = None
    unit: Optional[str] = None
    megatron: bool = False  # Megatron-LM defines it: ours only when its parser is absent
    bounds: Optional[Bounds] = None  # the value's range, checked by ``check_bounds``

    @property
    def dest(self) -> str:
        return self.names[0][2:].replace("-", "_")

    def argparse_kwargs(self) -> Dict[str, Any]:
        kwargs: Dict[str, Any] = {"help": self.help, "dest": self.dest}
        if self.action is not None:
            kwargs["action"] = self.action
            if self.action not in ("store_true", "store_false"):
                kwargs["default"] = self.default
        else:
            kwargs["default"] = self.default
        for key in ("type", "nargs", "metavar"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        if self.choices is not None:
            kwargs["choices"] = list(self.choices() if callable(self.choices) else self.choices)
        return kwargs

    def read(self, args, load_user_code: bool = True) -> Any:
        """The flag's value in the parsed namespace ``args`` (the one reader of it: a config is
        built from it). Megatron-LM's own flag absent from Megatron-LM's namespace (a version
        without it: our parser then defines it neither) reads as its declared default."""
        given = vars(args)
        return given.get(self.dest, self.default) if self.megatron else given[self.dest]


@dataclass(frozen=True)
class SameAs:
    """A field filled from a flag another config declares."""

    owner: type
    name: str

    def flag(self) -> Flag:
        return flag_of(self.owner, self.name)

    def read(self, args, load_user_code: bool = True) -> Any:
        return self.flag().read(args)


@dataclass(frozen=True)
class Derived:
    """A field computed from the parsed flags, once, when the config is built; ``inputs`` are the
    flags it declares (read only through ``fn``). ``user_code``: ``fn`` loads a user function
    (skipped, the field left at its default, when the tree is built only to check the rules)."""

    fn: Callable[[Any], Any]
    inputs: Tuple[Flag, ...] = ()
    user_code: bool = False

    def read(self, args, load_user_code: bool = True) -> Any:
        return self.fn(args)


RUNTIME = "runtime"  # the spec of a field that is no flag (``runtime``)


@dataclass(frozen=True)
class Nested:
    cls: type

    def read(self, args, load_user_code: bool = True) -> Any:
        return from_args(self.cls, args, load_user_code=load_user_code)


def option(
    *names: str,
    default: Any = None,
    help: str,
    group: str,
    type: Optional[Callable[[str], Any]] = None,
    choices=None,
    action: Optional[str] = None,
    nargs=None,
    metavar: Optional[str] = None,
    unit: Optional[str] = None,
    megatron: bool = False,
    bounds: Optional[Bounds] = None,
):
    """The flag ``names[0]`` as a ``Flag`` (no field): an input of ``derived``."""
    if not names or not all(n.startswith("--") for n in names):
        raise ValueError(f"flag names must start with '--': {names}")
    if action == "store_true":
        default = False
    return Flag(tuple(names), help, group, default, type, choices, action, nargs, metavar, unit, megatron, bounds)


def flag(*names: str, **kwargs):
    """A dataclass field that is the flag ``names[0]`` (see the module docstring; ``option``'s
    arguments)."""
    spec = option(*names, **kwargs)
    if isinstance(spec.default, (list, dict, set)):
        return field(default_factory=lambda: copy.copy(spec.default), metadata={SPEC: spec})
    return field(default=spec.default, metadata={SPEC: spec})


def same_as(owner: type, name: str):
    """A field that reads the flag declared by ``owner.name`` (its default too); ``name`` may also
    be the dest of a flag ``owner`` declares as a ``derived`` input."""
    spec = flag_of(owner, name)
    return field(default=spec.default, metadata={SPEC: SameAs(owner, name)})


def derived(fn: Callable[[Any], Any], default: Any, *, inputs: Sequence[Flag] = (), user_code: bool = False):
    """A field computed from the parsed flags: ``fn(args)``; ``default`` when built by hand (it
    equals ``fn`` of the parser's defaults). ``inputs``: the flags it declares (``option(...)``);
    ``user_code``: ``fn`` loads a user function named by a flag (see ``from_args``)."""
    return field(default=default, metadata={SPEC: Derived(fn, tuple(inputs), user_code)})


def runtime(default: Any = None):
    """A field that is no flag: runtime state passed by hand (``from_args(..., name=value)``)."""
    return field(default=default, metadata={SPEC: RUNTIME})


def nested(cls: type):
    return field(default_factory=cls, metadata={SPEC: Nested(cls)})


def flag_of(cls: type, name: str) -> Flag:
    """The flag of field ``name`` of ``cls`` (or the ``derived`` input of ``cls`` whose dest is ``name``)."""
    for f in fields(cls):
        if f.name == name:
            spec = f.metadata.get(SPEC)
            if isinstance(spec, SameAs):
                return spec.flag()
            if isinstance(spec, Flag):
                return spec
            raise TypeError(f"{cls.__name__}.{name} is not a flag")
    for _, spec in declared_flags(cls):
        if spec.dest == name:
            return spec
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def declared_flags(cls: type) -> Iterator[Tuple[str, Flag]]:
    """``(field name, Flag)`` of every flag ``cls`` itself declares, in field order, a ``derived``
    field's inputs included (not those of its nested configs, nor the ``same_as`` fields: their
    owner declares them)."""
    for f in fields(cls):
        spec = f.metadata.get(SPEC)
        if isinstance(spec, Flag):
            yield f.name, spec
        elif isinstance(spec, Derived):
            for one in spec.inputs:
                yield f.name, one


def from_args(cls: type, args, *, load_user_code: bool = True, **given):
    """Build ``cls`` from parsed flags; ``given`` fields are taken as they are. A field without a
    spec keeps its default (runtime state is passed in ``given``). ``load_user_code=False``: the
    ``derived(..., user_code=True)`` fields keep their defaults (the tree the rules check is built
    before the functions the flags name are known to load; the rules name a bad one)."""
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass config")
    values = dict(given)
    for f in fields(cls):
        spec = f.metadata.get(SPEC)
        if f.name in values or spec is None or spec is RUNTIME or not f.init:
            continue
        if isinstance(spec, Derived) and spec.user_code and not load_user_code:
            continue
        values[f.name] = spec.read(args, load_user_code)
    return cls(**values)


def check_bounds(config) -> None:
    """Every flag field of the config instance ``config`` with ``bounds`` holds them (a value left
    unset, None, is skipped). Raises ``RLArgumentError`` naming the flag, the range and a fix."""
    from rl_plugin.errors import fail

    for f in fields(config):
        spec = f.metadata.get(SPEC)
        if not isinstance(spec, Flag) or spec.bounds is None:
            continue
        value = getattr(config, f.name)
        if value is not None and not spec.bounds.holds(value):
            fail(spec.names[0], f"must be {spec.bounds.describe()} (got {value})", f"use e.g. {spec.bounds.example}")


class Declared:
    """Base of a declared config: ``Config.from_args(args, **given)`` is ``from_args(Config, ...)``.
    Its rules are the instance methods ``check(run)`` (and ``check_world(run, dp_size=...)``),
    ``run`` the whole tree (``rl_plugin.configs.run.RunConfig``): a rule reads its own fields and
    the other configs' through the tree, never the namespace."""

    @classmethod
    def from_args(cls, args, **given):
        return from_args(cls, args, **given)
