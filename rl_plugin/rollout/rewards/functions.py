"""Reward functions: built-in verifiers by name (``--rm-type``) and user functions (``--custom-rm-path``).

A reward function is ``fn(prompt, response: str, label) -> float``; ``prompt`` is
``Sample.prompt``, slime's form in every path (the default generation and a generate hook): the
dataset's prompt after the chat template with ``--apply-chat-template``, the string itself without. A function that also takes a keyword
``metadata`` (or ``**kwargs``) gets the sample's ``--metadata-key`` object as ``metadata=`` (``{}``
when no metadata key is configured); the three-argument form is called as before. Built-ins:

- ``digit_match``: the embedded tasks' partial-credit checker (``rollout.data.task.digit_match_reward``): the
  fraction of label positions the response matches.
- ``math_exact``: 1.0 when the response's final answer (last ``\\boxed{...}``, else the last number)
  equals the label after light normalisation (spaces, ``$``, trailing ``.0``), else 0.0.

A label that is a JSON number (``int`` or ``float``, not ``true``/``false``) is compared as a
number: ``math_exact`` scores 1.0 when the final answer's exact value (``Fraction`` of "7", "7.00",
"1/2", "1,000") equals it (an int exactly; a float as the float nearest the answer, so "0.1"
matches 0.1); ``digit_match`` gives full credit to a response whose value equals it, and otherwise
partial credit against the number's shortest text (7.0 -> "7", never "7.0"). The built-ins need a
label: preflight refuses null or empty ones (``rollout.data.prompt_check.check_labels``).

``--custom-rm-path`` is ``package.module:function``, ``package.module.function`` or
``path/to/file.py:function``, with the same signature; it replaces ``--rm-type``. The rollout
scores through ``rl_plugin.rollout.rewards.scorer.SampleScorer``, which also takes slime's
``rm(args, sample)`` / ``--group-rm`` forms and ``--rm-type remote_rm`` (``remote_rm.py``) and
calls ``score_responses`` below for this module's form.
"""

from __future__ import annotations

import inspect
import math
import re
from fractions import Fraction
from typing import Callable, List, Sequence

from rl_plugin.registries import REWARDS  # the names (--rm-type); entries point at the functions below
from rl_plugin.rollout.data.task import digit_match_reward
from rl_plugin.user_code import UserCodeError, describe_exception, load_function, where

RewardFn = Callable[[str, str, object], float]


def register_reward(name: str):
    """``@register_reward(name)``: add your own built-in to ``rl_plugin.registries.REWARDS``."""
    return REWARDS.register(name)


LABEL_REWARDS = ("digit_match", "math_exact")  # built-ins that compare the response with the label


def is_number(label) -> bool:
    """A JSON number: int or float (JSON true/false parse as bool, a subclass of int: not numbers)."""
    return isinstance(label, (int, float)) and not isinstance(label, bool)


def label_text(label) -> str:
    """The label as text: an integral float in its integer form (7.0 -> "7"), anything else ``str``."""
    if isinstance(label, float) and label.is_integer():
        return str(int(label))
    return str(label)


def numbers_equal(answer: str, label) -> bool:
    """The exact value of ``answer`` ("7", "-3.50", "1/2", "1,000", "$7$") equals the numeric
    ``label``: exactly for an int, as the nearest float for a float."""
    try:
        value = Fraction(_normalise(answer))
        return value == label if isinstance(label, int) else float(value) == label
    except (ValueError, ZeroDivisionError, OverflowError):
        return False


def digit_match(prompt: str, response: str, label) -> float:
    if is_number(label) and numbers_equal(response, label):
        return 1.0
    return digit_match_reward(response, label_text(label))


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
    answer = extract_final_answer(response)
    if is_number(label):
        return float(numbers_equal(answer, label))
    return float(_normalise(answer) == _normalise(str(label)) != "")


class RewardFunctionError(UserCodeError):
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


def _load_custom(spec: str) -> RewardFn:
    """``--custom-rm-path``'s function through the one user-code loader (``rl_plugin.user_code``)."""
    try:
        fn = load_function(spec, "--custom-rm-path")
    except UserCodeError as exc:  # already names the file:line and the fix
        raise RewardFunctionError(str(exc)) from None
    file = where(fn).rsplit(":", 1)[0]
    return CustomReward(fn, spec, None if file == "?" else file)


def describe_reward_function(fn: RewardFn) -> str:
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
            f"{describe_reward_function(fn)} raised {describe_exception(exc, source)} on sample {i} of the rollout (prompt {p!r}, response {r!r}, "
            f"label {lab!r}). Fix: make the function return a float for every sample; it is called as {form}"
        ) from None
    return _checked(values, prompts, responses)


NOT_A_REWARD = "a bool or a string is not taken for a number: return float(x), or 1.0 / 0.0 for a pass / fail"


def reward_number(v) -> float:
    """A reward as a float: a number (int, float, a NumPy or 0-d tensor scalar). A bool (Python's or
    NumPy's) or a string is refused (``TypeError``): ``float(True)`` or ``float("0.5")`` would quietly
    turn a verdict or an unparsed text into a reward."""
    if isinstance(v, (bool, str, bytes)) or "bool" in str(getattr(v, "dtype", "")):
        raise TypeError(NOT_A_REWARD)
    return float(v)


def _checked(values: List[object], prompts: Sequence[str], responses: Sequence[str]) -> List[float]:
    """``values`` as floats; a ValueError naming the first non-numeric or non-finite one."""
    try:
        out = list(map(reward_number, values))
    except (TypeError, ValueError):
        out = None
    if out is None or not all(map(math.isfinite, out)):
        for i, value in enumerate(values):
            try:
                value = reward_number(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"reward function returned {value!r} ({type(value).__name__}) for sample {i} (prompt {prompts[i]!r}); "
                    f"it must return a float ({NOT_A_REWARD})"
                ) from None
            if not math.isfinite(value):
                raise ValueError(
                    f"reward function returned {value} for sample {i} (prompt {prompts[i]!r}, response {responses[i]!r}); "
                    "rewards must be finite"
                ) from None
    return out


def get_reward_value(sample, args) -> float:
    """slime's accessor as a function (exported as ``rl_plugin.rollout.get_reward_value``): the
    number of ``sample.reward``, a dict reward's entry under ``--reward-key`` (``"reward"`` when
    unset); the same as ``sample.get_reward_value(args)``."""
    return sample.get_reward_value(args)
