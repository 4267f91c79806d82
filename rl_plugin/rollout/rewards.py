"""Reward functions: built-in verifiers by name (``--rm-type``) and user functions (``--custom-rm-path``).

A reward function is ``fn(prompt, response: str, label) -> float``; ``prompt`` is the dataset's
input as it is (a string, or the list of chat messages). A function that also takes a keyword
``metadata`` (or ``**kwargs``) gets the sample's ``--metadata-key`` object as ``metadata=`` (``{}``
when no metadata key is configured); the three-argument form is called as before. Built-ins:

- ``digit_match``: the embedded tasks' partial-credit checker (``task.digit_match_reward``): the
  fraction of label positions the response matches.
- ``math_exact``: 1.0 when the response's final answer (last ``\\boxed{...}``, else the last number)
  equals the label after light normalisation (spaces, ``$``, trailing ``.0``), else 0.0.

``--custom-rm-path`` is ``package.module:function``, ``package.module.function`` or
``path/to/file.py:function``, with the same signature; it replaces ``--rm-type``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import traceback
from pathlib import Path
from typing import Callable, List, Sequence

from rl_plugin.registries import REWARDS  # the names (--rm-type); entries point at the functions below
from rl_plugin.rollout.task import digit_match_reward

RewardFn = Callable[[str, str, object], float]


def register_reward(name: str):
    """``@register_reward(name)``: add your own built-in to ``rl_plugin.registries.REWARDS``."""
    return REWARDS.register(name)


def digit_match(prompt: str, response: str, label) -> float:
    return digit_match_reward(response, str(label))


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _normalise(answer: str) -> str:
    a = answer.strip().strip("$").replace(" ", "").replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", a):
        a = a.split(".")[0]
    return a


def extract_final_answer(response: str) -> str:
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else ""


def math_exact_reward(prompt: str, response: str, label) -> float:
    return float(_normalise(extract_final_answer(response)) == _normalise(str(label)) != "")


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded or that raised; the message names the flag, the
    file:line in the user's code, and (when scoring) the sample index and its prompt."""


def takes_metadata(fn) -> bool:
    """True when ``fn`` accepts a ``metadata`` keyword (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return any(
        (p.name == "metadata" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or p.kind is p.VAR_KEYWORD
        for p in params
    )


class CustomReward:
    """``--custom-rm-path``'s function, with where it came from (for error messages)."""

    def __init__(self, fn: RewardFn, spec: str, source: str | None):
        self.fn, self.spec, self.source = fn, spec, source
        self.takes_metadata = takes_metadata(fn)

    def __call__(self, prompt, response: str, label, **kw) -> float:
        return self.fn(prompt, response, label, **kw)


def load_reward_fn(rm_type: str, custom_rm_path: str | None = None) -> RewardFn:
    if custom_rm_path:
        return _load_custom(custom_rm_path)
    if rm_type not in REWARDS:
        raise ValueError(
            f"--rm-type {rm_type!r}: unknown reward; built-ins are {', '.join(REWARDS.names())}, or pass --custom-rm-path"
        )
    return REWARDS.get(rm_type)


def _user_frame(exc: BaseException, source: str | None):
    """The innermost traceback frame in the user's file (else the innermost one): (file, line, code)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno, (exc.text or "").strip()
    mine = [f for f in frames if source and Path(f.filename).resolve() == Path(source).resolve()]
    f = (mine or frames or [None])[-1]
    return (f.filename, f.lineno, (f.line or "").strip()) if f is not None else ("?", 0, "")


def _where(exc: BaseException, source: str | None) -> str:
    file, line, code = _user_frame(exc, source)
    msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return f"{type(exc).__name__}: {msg} at {file}:{line}" + (f" (`{code}`)" if code else "")


def _load_custom(spec: str) -> RewardFn:
    if ":" in spec:
        target, name = spec.rsplit(":", 1)
    elif "." in spec:
        target, name = spec.rsplit(".", 1)
    else:
        raise ValueError(f"--custom-rm-path {spec!r}: expected package.module:function or path/to/file.py:function")
    source = None
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise FileNotFoundError(f"no such file {path}")
            source = str(path)
            module_spec = importlib.util.spec_from_file_location(f"_rl_plugin_custom_rm_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
            source = getattr(module, "__file__", None)
        fn = getattr(module, name)
    except (ImportError, FileNotFoundError, AttributeError) as exc:
        raise ValueError(f"--custom-rm-path {spec!r}: cannot load the reward function: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say where
        raise RewardFunctionError(
            f"--custom-rm-path {spec}: the reward module failed to import: {_where(exc, source or target)}. "
            f"Fix: correct the module at that line"
        ) from None
    if not callable(fn):
        raise ValueError(f"--custom-rm-path {spec!r}: {name} is not callable")
    return CustomReward(fn, spec, source)


def _describe(fn: RewardFn) -> str:
    if isinstance(fn, CustomReward):
        return f"--custom-rm-path {fn.spec}"
    name = next((k for k in REWARDS.names() if REWARDS.get(k) is fn), getattr(fn, "__name__", repr(fn)))
    return f"--rm-type {name}"


def score_responses(
    fn: RewardFn,
    prompts: Sequence,
    responses: Sequence[str],
    labels: Sequence,
    metadata: Sequence | None = None,
) -> List[float]:
    """Apply ``fn`` to every sample (with ``metadata=`` when it takes it, ``{}`` for a sample
    without); a reward function that raises, or returns a non-numeric or non-finite reward, stops
    the rollout naming the first such sample (and, for a raise, the file:line). ``fn`` is called
    once per sample, in order; the checks run as C-level passes over all rewards, and only a
    failed one looks for the sample to name."""
    values: List[object] = []
    call = values.append
    with_meta = fn.takes_metadata if isinstance(fn, CustomReward) else takes_metadata(fn)
    try:
        if with_meta:
            metas = metadata if metadata is not None else [None] * len(prompts)
            for p, r, lab, m in zip(prompts, responses, labels, metas):
                call(fn(p, r, lab, metadata={} if m is None else m))
        else:
            for p, r, lab in zip(prompts, responses, labels):
                call(fn(p, r, lab))
    except Exception as exc:  # noqa: BLE001 - re-raised with the user's file:line and the sample
        _checked(values, prompts, responses)  # a bad reward of an earlier sample is named first
        i = len(values)
        p, r, lab = prompts[i], responses[i], labels[i]
        source = fn.source if isinstance(fn, CustomReward) else None
        form = "fn(prompt, response, label, metadata=...)" if with_meta else "fn(prompt, response, label)"
        raise RewardFunctionError(
            f"{_describe(fn)} raised {_where(exc, source)} on sample {i} of the rollout (prompt {p!r}, response {r!r}, "
            f"label {lab!r}). Fix: make the function return a float for every sample; it is called as {form}"
        ) from None
    return _checked(values, prompts, responses)


def _checked(values: List[object], prompts: Sequence[str], responses: Sequence[str]) -> List[float]:
    """``values`` as floats; a ValueError naming the first non-numeric or non-finite one."""
    try:
        out = list(map(float, values))
    except (TypeError, ValueError):
        out = None
    if out is None or not all(map(math.isfinite, out)):
        for i, value in enumerate(values):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"reward function returned {value!r} for sample {i} (prompt {prompts[i]!r}); it must return a float"
                ) from None
            if not math.isfinite(value):
                raise ValueError(
                    f"reward function returned {value} for sample {i} (prompt {prompts[i]!r}, response {responses[i]!r}); "
                    "rewards must be finite"
                ) from None
    return out
