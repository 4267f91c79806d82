"""Import a user's function named by a flag: the one loader, and the one set of accepted forms, of
``--custom-rm-path``, ``--dynamic-sampling-filter-path``, ``--custom-tis-function-path`` and
``--custom-pg-loss-reducer-function-path``:

    package.module:function     package.module.function     path/to/file.py:function

A bottom-layer module, so the flag checker, the loss core and the rollout side share it. Three
steps, each usable alone:

- ``split_spec``: the form (``ValueError`` naming the flag and the accepted forms);
- ``check_source``: without running user code, the file exists and compiles (a syntax error is
  named at its file:line) or the module is on the Python path (``RLArgumentError``), for the flag
  checker on a machine that may not hold the cluster's packages;
- ``check_importable``: load it now, for the flag checks (``RLArgumentError``);
- ``load_function``: import and return the callable; a module that raises while importing is named
  at the user's file:line (``UserCodeError``), a function that cannot be found is a
  ``UserFunctionNotFound`` naming the flag, the spec and why, with the names the module does define
  (a bad form: ``ValueError``). Both pickle, so they cross Ray as themselves.

``where(fn)`` is the function's own ``file:line`` (``inspect``), for errors about what it returned.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Tuple

from rl_plugin.errors import RLArgumentError, fail

FORMS = "package.module:function, package.module.function or path/to/file.py:function"


class UserCodeError(ValueError):
    """The user's module raised while importing; the message names the flag, the file:line and the fix."""


class UserFunctionNotFound(ValueError):
    """The function named by a flag cannot be found (no file, no module, no such callable);
    ``reason`` says which, without the flag. Picklable (``__reduce__``): raised in a Ray actor, it
    reaches the driver as itself, not as Ray's ``UnserializableException``."""

    def __init__(self, flag: str, spec: str, reason: str):
        super().__init__(f"{flag} {spec!r}: cannot load the function: {reason}")
        self.flag, self.spec, self.reason = flag, spec, reason

    def __reduce__(self):
        return type(self), (self.flag, self.spec, self.reason)


def split_spec(spec: str, flag: str) -> Tuple[str, str]:
    """``(module or file, function name)`` of ``spec``; ``ValueError`` for any other form."""
    if ":" in spec:
        target, _, name = spec.rpartition(":")
    else:
        target, _, name = spec.rpartition(".")
    if not target or not name or spec.endswith(".py") or ("/" in target and not target.endswith(".py")):
        raise ValueError(f"{flag} {spec!r}: expected {FORMS}")
    return target, name


def check_source(spec: Optional[str], flag: str) -> None:
    """The flag checker's test (no user code runs): the form, then the file exists and compiles or
    the module can be found. ``RLArgumentError`` with the rule and the fix."""
    if spec is None:
        return
    try:
        target, _ = split_spec(spec, flag)
    except ValueError:
        fail(f"{flag} {spec}", f"expected {FORMS}", "name the module (or the file) and the function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            fail(
                f"{flag} {spec}",
                f"the file {path} does not exist",
                f"pass path/to/file.py:function or {FORMS.split(',')[0]}",
            )
        try:
            compile(path.read_text(), str(path), "exec")
        except SyntaxError as exc:
            code = (exc.text or "").strip()
            fail(
                f"{flag} {spec}",
                f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}" + (f" in `{code}`" if code else ""),
                f"correct the module at {exc.filename}:{exc.lineno}",
            )
        return
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        found = None
    if found is None:
        fail(
            f"{flag} {spec}",
            f"no module {target!r} on the Python path",
            f"install it, add its directory to PYTHONPATH, or pass path/to/{target.rsplit('.', 1)[-1]}.py:function",
        )


def _user_frame(exc: BaseException, source: Optional[str]):
    """The innermost traceback frame in the user's file (else the innermost one): (file, line, code)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno, (exc.text or "").strip()
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if source and Path(f.filename).resolve() == Path(source).resolve()]
    f = (mine or frames or [None])[-1]
    return (f.filename, f.lineno, (f.line or "").strip()) if f is not None else ("?", 0, "")


def describe_exception(exc: BaseException, source: Optional[str]) -> str:
    """``Type: message at file:line (`code`)``, the frame taken in ``source`` when it is there."""
    file, line, code = _user_frame(exc, source)
    msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return f"{type(exc).__name__}: {msg} at {file}:{line}" + (f" (`{code}`)" if code else "")


def _exec_file(path: Path):
    """A module from a ``.py`` file, registered in ``sys.modules`` under a private name while it
    runs (``dataclasses`` and pickling look the module up there)."""
    name = f"_rl_plugin_user_{path.stem}_{abs(hash(str(path.resolve()))):x}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _origin(source: Optional[str]) -> Optional[str]:
    """The file of a ``.py`` path or a module name (None when it cannot be found)."""
    if source is None or source.endswith(".py"):
        return source
    try:
        return getattr(importlib.util.find_spec(source), "origin", None)
    except (ImportError, ValueError):
        return None


# rl_plugin's own modules that users name in flags and that moved: the old path keeps loading
# (a flag written against an earlier release must not break on a reorganisation of the package).
MOVED_MODULES = {"rl_plugin.rollout.filters": "rl_plugin.rollout.dapo.filters"}


def load_function(spec: str, flag: str) -> Callable:
    """The callable named by ``spec`` (any of ``FORMS``). ``UserCodeError`` when the user's module
    raises while importing (named at its file:line); ``UserFunctionNotFound`` naming ``flag`` when
    it cannot be found or is not callable; ``ValueError`` for a spec of no accepted form."""
    target, name = split_spec(spec, flag)
    source = None
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise UserFunctionNotFound(flag, spec, f"no such file {path}")
            source = str(path)
            module = _exec_file(path)
        else:
            source = target = MOVED_MODULES.get(target, target)
            try:
                module = importlib.import_module(target)
            except ImportError as exc:
                raise UserFunctionNotFound(flag, spec, f"cannot import {target!r}: {exc}") from exc
    except UserFunctionNotFound:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say where
        raise UserCodeError(
            f"{flag} {spec}: the module failed to import: {describe_exception(exc, _origin(source))}. "
            "Fix: correct the module at that line"
        ) from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise UserFunctionNotFound(flag, spec, f"{target!r} has no callable {name!r}; {defined_functions(module)}")
    return fn


def check_importable(spec: str, flag: str) -> None:
    """Load the function now, for the flag checks: ``RLArgumentError`` naming the flag, why, and the
    forms (a module that raises while importing: its file:line and the fix)."""
    try:
        load_function(spec, flag)
    except UserCodeError as exc:
        raise RLArgumentError(str(exc)) from None
    except ValueError as exc:
        reason = getattr(exc, "reason", str(exc))
        fix = (
            "correct the name after the ':' (or define that function in the module)"
            if "has no callable" in reason
            else f"pass {FORMS}, importable from here (PYTHONPATH)"
        )
        fail(flag, f"cannot load the function {spec!r}: {reason}", fix)


def defined_functions(module) -> str:
    """What ``module`` defines at top level that a flag could name: its functions (and classes),
    in source order, as one phrase for a "no such function" message."""
    own = [
        k
        for k, v in vars(module).items()
        if not k.startswith("_")
        and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == module.__name__
    ]
    if not own:
        return "it defines no function"
    shown = ", ".join(own[:20]) + (f" and {len(own) - 20} more" if len(own) > 20 else "")
    return f"it defines: {shown}"


def where(fn: Callable) -> str:
    """``file:line`` where ``fn`` is defined (its class's, for a callable object), or ``?``."""
    target = fn if inspect.isroutine(fn) or inspect.isclass(fn) else type(fn)
    target = inspect.unwrap(target)
    try:
        file = inspect.getsourcefile(target) or inspect.getfile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return "?"
    return f"{file}:{line}"
