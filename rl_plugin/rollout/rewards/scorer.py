"""Scoring a rollout's ``Sample`` objects: the one seam between generation and rewards.

``SampleScorer(config)`` is built from the run's ``RolloutConfig`` (its ``rm_type``,
``custom_rm_path``, ``group_rm``, ``reward_key``, ``rm_url``, ``rm_max_concurrency``,
``rm_timeout``, ``rm_max_retries``, ``n_samples_per_prompt``), never from the flags' namespace.
``await scorer.score(samples)`` sets every ``sample.reward`` and returns the rewards as floats, in
order; ``scorer.score_samples(samples)`` is the same from synchronous code (it runs its own event
loop, so it refuses to run inside one: await ``score`` there). The reward forms, chosen by the
function's required positional parameters (``metadata`` not counted):

- three, ``fn(prompt, response, label)``, optionally with a ``metadata`` keyword
  (``rl_plugin.rollout.rewards.functions``: the built-ins and today's ``--custom-rm-path``): a sync
  function runs through ``functions.score_responses`` unchanged (same calls, same checks, same
  errors); an ``async`` one is awaited for all samples concurrently;
- two, slime's ``rm(args, sample) -> reward`` (``async`` or not): called once per sample, all
  samples concurrently; ``args`` is ``user_args`` (the run's parsed flags, as the generate hook
  gets them), else the config;
- with ``--group-rm``, slime's ``rm(args, samples) -> list of rewards``: called once per
  contiguous group of ``group_size`` samples (``--n-samples-per-prompt`` by default), all groups
  concurrently; it must return one reward per sample of its group;
- ``--rm-type remote_rm``: every sample POSTed to ``--rm-url`` (``rl_plugin.rollout.rewards.remote_rm``)
  in one HTTP session, at most ``--rm-max-concurrency`` at a time. A ``--custom-rm-path`` rm may
  call slime's ``remote_rm(args, sample)`` itself (with ``--rm-url``): its calls go through the
  process's one client, so the same bound holds over all of them.

With neither ``--rm-type`` nor ``--custom-rm-path`` (an agent run whose agent returns the
rewards; ``RolloutConfig`` refuses it elsewhere) the scorer is not ``configured`` and refuses to
score.

In slime's forms and from the server, a reward is a number or a dict holding it under
``--reward-key`` (default ``"reward"``); the dict is kept whole as ``sample.reward`` and the number
is returned (the sync three-argument form returns a float, as ``score_responses`` checks). A function that raises stops the
rollout naming the flag, the user's file:line and the first such sample (index, prompt,
response, label); a reward that is not a number or not finite names the sample too.

Deadline: a ``--custom-rm-path`` function's every call (per sample; per group with ``--group-rm``)
must return within ``--rm-timeout`` seconds (``DEFAULT_LOCAL_TIMEOUT_S`` when unset; the remote
client reads the flag per request): an ``async def`` is cancelled, a plain ``def`` runs in a worker
thread (``rollout.deadlines``; left behind when stuck, the calls queued behind it served by a fresh
one), and the rollout stops at the first call past it (the other calls cancelled) naming the
function, its file:line and the sample. The built-in verifiers run as before, without one.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
from typing import Any, List, Optional, Sequence

from rl_plugin.configs.rewards import DEFAULT_LOCAL_TIMEOUT_S
from rl_plugin.rollout import abort
from rl_plugin.rollout.deadlines import SerialWorker, UserCallTimeout, call_with_deadline, gather_calls
from rl_plugin.rollout.rewards.functions import (
    NOT_A_REWARD,
    CustomReward,
    RewardFunctionError,
    describe_reward_function,
    load_reward_fn,
    reward_number,
    score_responses,
    takes_metadata,
)
from rl_plugin.rollout.rewards.remote_rm import RemoteRewardModel, shared_client
from rl_plugin.rollout.sample import Sample
from rl_plugin.user_code import describe_exception, where

PROMPT_RESPONSE_LABEL = "fn(prompt, response, label)"
SAMPLE = "rm(args, sample)"
GROUP = "rm(args, samples)"
REMOTE = "remote_rm"
NONE = "no reward"  # neither --rm-type nor --custom-rm-path: an agent run whose agent returns the rewards


def required_positionals(fn) -> Optional[int]:
    """Required positional parameters of ``fn`` (a ``metadata`` one not counted); None when it
    takes ``*args`` or has no signature."""
    target = fn.fn if isinstance(fn, CustomReward) else fn
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty and p.name != "metadata"
        for p in params
    )


def is_async(fn) -> bool:
    """An ``async def`` function (or a callable object whose ``__call__`` is one)."""
    target = _target(fn)
    return inspect.iscoroutinefunction(target if inspect.isroutine(target) else type(target).__call__)


def reward_form(fn, *, group_rm: bool, spec: str = "") -> str:
    """The form ``fn`` is called in (see the module docstring); ``--group-rm`` with a function
    that does not take ``(args, samples)`` is refused naming both flags and the fix."""
    n = required_positionals(fn)
    if group_rm:
        if n != 2:
            raise RewardFunctionError(
                f"--group-rm with --custom-rm-path {spec}: the function at {where(_target(fn))} takes {_params(fn)}, but "
                "--group-rm calls rm(args, samples) once per group of --n-samples-per-prompt samples and needs one reward "
                "per sample back. Fix: write it as `async def rm(args, samples) -> list[float]`, or drop --group-rm to "
                "score one sample per call"
            )
        return GROUP
    return SAMPLE if n == 2 else PROMPT_RESPONSE_LABEL


def _target(fn):
    return fn.fn if isinstance(fn, CustomReward) else fn


def _params(fn) -> str:
    try:
        return f"{getattr(_target(fn), '__name__', 'fn')}{inspect.signature(_target(fn))}"
    except (TypeError, ValueError):
        return "an unknown signature"


async def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, awaited when it returns an awaitable (a sync function's raise is
    then the coroutine's, so ``gather`` collects it with the others)."""
    value = fn(*args, **kwargs)
    return await value if inspect.isawaitable(value) else value


class SampleScorer:
    """The rollout's reward: see the module docstring."""

    def __init__(self, config, *, user_args: Any = None):
        self.user_args = config if user_args is None else user_args
        self.group_rm = bool(config.group_rm)
        self.group_size = int(config.n_samples_per_prompt or 1)
        self.reward_key = config.reward_key or "reward"
        rm_type, custom = config.rm_type, config.custom_rm_path
        self.remote: Optional[RemoteRewardModel] = None
        self.fn = None
        if rm_type is None and not custom:  # only an agent run gets here (RolloutConfig's rule)
            self.form, self.who = NONE, "no reward (neither --rm-type nor --custom-rm-path)"
        elif rm_type == REMOTE and not custom:
            self.remote = shared_client(config)  # the process's one client: its bound covers remote_rm() calls too
            self.form = REMOTE
            self.who = f"--rm-url {self.remote.url}"
        else:
            self.fn = load_reward_fn(rm_type, custom)
            self.form = reward_form(self.fn, group_rm=self.group_rm, spec=custom or "")
            self.who = describe_reward_function(self.fn)
        self.source = self.fn.source if isinstance(self.fn, CustomReward) else None
        self.sync = self.form == PROMPT_RESPONSE_LABEL and not is_async(self.fn)
        # the deadline of a user function's calls (module docstring); None: a built-in, no deadline
        self.timeout = None
        if isinstance(self.fn, CustomReward):
            self.timeout = float(config.rm_timeout) if config.rm_timeout is not None else DEFAULT_LOCAL_TIMEOUT_S
        self.worker = SerialWorker("rl_plugin-reward")
        self._late: Optional[int] = None  # the sample whose sync call passed its deadline

    @property
    def configured(self) -> bool:
        """Whether the run has a reward of its own (an agent run may leave it to the agent)."""
        return self.form != NONE

    # -- entry points -------------------------------------------------------------------------
    def score_samples(self, samples: Sequence[Sample], *, group_size: Optional[int] = None) -> List[float]:
        """``score`` from synchronous code (a thread with no running event loop)."""
        what = f"the reward {self.who} ({self.form})"  # named if an exit signal finds it running
        if self.sync:
            with abort.phase(what):
                return self._score_sync(samples)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return abort.run(self.score(samples, group_size=group_size), what)
        raise RuntimeError(
            "SampleScorer.score_samples was called inside a running event loop, which it cannot block; "
            "use `await scorer.score(samples)` there"
        )

    async def score(self, samples: Sequence[Sample], *, group_size: Optional[int] = None) -> List[float]:
        """Set every ``sample.reward``; return the rewards as floats, in order."""
        if not self.configured:
            raise RewardFunctionError(
                f"{len(samples)} samples to score and no reward configured. Fix: pass --rm-type or --custom-rm-path"
            )
        if self.sync:
            return self._score_sync(samples)
        if self.form == REMOTE:
            values = await self.remote.score(samples)
        elif self.form == GROUP:
            values = await self._score_groups(samples, group_size or self.group_size)
        else:
            values = await self._score_each(samples)
        out = self._floats(values, samples)
        for s, v in zip(samples, values):
            s.reward = v
        return out

    # -- the forms ----------------------------------------------------------------------------
    def _score_sync(self, samples: Sequence[Sample]) -> List[float]:
        prompts = [s.prompt for s in samples]
        fn, self._late = self.fn, None
        if self.timeout is not None:  # the user's function, each call in the worker under the deadline
            fn = copy.copy(self.fn)
            fn.fn = self._deadlined(self.fn.fn)
        try:
            out = score_responses(
                fn,
                prompts,
                [s.response for s in samples],
                [s.label for s in samples],
                [s.metadata for s in samples],
            )
        except RewardFunctionError:
            if self._late is not None:
                raise self._timeout_error(self._late, samples, "did not return within --rm-timeout") from None
            raise
        for s, v in zip(samples, out):
            s.reward = v
        return out

    def _deadlined(self, fn):
        """``fn`` called in the worker under ``--rm-timeout``; a call past it records its sample
        (the calls' count: ``score_responses`` calls once per sample, in order)."""
        calls = [0]

        def call(*args, **kwargs):
            calls[0] += 1
            try:
                return self.worker.call(fn, *args, timeout=self.timeout, what="--rm-timeout", **kwargs)
            except UserCallTimeout:
                self._late = calls[0] - 1
                raise

        return call

    def _timeout_error(self, i: int, samples: Sequence[Sample], what: str) -> RewardFunctionError:
        s = samples[i]
        return RewardFunctionError(
            f"{self.who} (defined at {where(_target(self.fn))}) {what} {self.timeout:g} s on sample {i} of the rollout "
            f"(group {s.group_index}, prompt {s.prompt!r}, response {s.response!r}). Fix: give the function's own waits "
            "(a judge, a sandbox, an API) their timeouts, or raise --rm-timeout if a call legitimately takes longer"
        )

    def _call(self, fn, *args, **kwargs):
        """One call of the reward: under the deadline for a user function (module docstring)."""
        if self.timeout is None:
            return _call(fn, *args, **kwargs)
        return call_with_deadline(fn, *args, timeout=self.timeout, what="--rm-timeout", worker=self.worker, **kwargs)

    async def _score_each(self, samples: Sequence[Sample]) -> List[Any]:
        fn, call = _target(self.fn), self._call
        if self.form == SAMPLE:
            calls = [call(fn, self.user_args, s) for s in samples]
        elif takes_metadata(fn):
            calls = [call(fn, s.prompt, s.response, s.label, metadata=s.metadata or {}) for s in samples]
        else:
            calls = [call(fn, s.prompt, s.response, s.label) for s in samples]
        results = await gather_calls(calls)  # the first deadline passed cancels the other calls
        late = next((i for i, r in enumerate(results) if isinstance(r, UserCallTimeout)), None)
        if late is not None:
            raise self._timeout_error(late, samples, "did not return within --rm-timeout")
        bad = next((i for i, r in enumerate(results) if isinstance(r, BaseException)), None)
        if bad is not None:
            s = samples[bad]
            raise RewardFunctionError(
                f"{self.who} raised {describe_exception(results[bad], self.source)} on sample {bad} of the rollout "
                f"(prompt {s.prompt!r}, response {s.response!r}, label {s.label!r}). Fix: make the function return a "
                f"reward for every sample; it is called as {self.form}"
            )
        return results

    async def _score_groups(self, samples: Sequence[Sample], size: int) -> List[Any]:
        if len(samples) % size:
            raise ValueError(f"--group-rm: {len(samples)} samples do not split into groups of {size}")
        groups = [samples[i : i + size] for i in range(0, len(samples), size)]
        calls = [self._call(_target(self.fn), self.user_args, list(g)) for g in groups]
        results = await gather_calls(calls)  # the first deadline passed cancels the other calls
        late = next((k for k, r in enumerate(results) if isinstance(r, UserCallTimeout)), None)
        if late is not None:
            what = f"(--group-rm, group {late}) did not return within --rm-timeout"
            raise self._timeout_error(late * size, samples, what)
        out: List[Any] = []
        for k, (group, r) in enumerate(zip(groups, results)):
            first = k * size
            if isinstance(r, BaseException):
                raise RewardFunctionError(
                    f"{self.who} (--group-rm) raised {describe_exception(r, self.source)} on group {k} of the rollout "
                    f"(samples {first}..{first + size - 1}, prompt {group[0].prompt!r}). Fix: make the function return one "
                    f"reward per sample of the group; it is called as {GROUP}"
                )
            try:
                got = list(r)
            except TypeError:
                got = None
            if got is None or len(got) != size:
                what = f"{len(got)} rewards" if got is not None else repr(r)
                raise RewardFunctionError(
                    f"{self.who} (--group-rm, defined at {where(_target(self.fn))}) returned {what} for group {k} of the "
                    f"rollout (samples {first}..{first + size - 1}, prompt {group[0].prompt!r}); it must return a list of "
                    f"{size} rewards, one per sample of the group, in order"
                )
            out.extend(got)
        return out

    # -- checks -------------------------------------------------------------------------------
    def _floats(self, values: Sequence[Any], samples: Sequence[Sample]) -> List[float]:
        """The numbers of ``values`` (a dict's under the reward key); ``ValueError`` naming the
        first sample whose reward is not a number or not finite."""
        key = self.reward_key
        if any(isinstance(v, dict) for v in values):
            values = [v.get(key, _MISSING) if isinstance(v, dict) else v for v in values]
        try:
            out = list(map(_number, values))
        except (TypeError, ValueError):
            out = None
        if out is not None and all(map(math.isfinite, out)):
            return out
        for i, v in enumerate(values):
            s = samples[i]
            if v is _MISSING:
                raise ValueError(
                    f"{self.who} returned a dict without the key {key!r} for sample {i} (prompt {s.prompt!r}); a dict "
                    f"reward holds the number under {key!r} (set the key with --reward-key)"
                )
            try:
                x = _number(v)
            except (TypeError, ValueError):
                raise ValueError(
                    f"{self.who} returned {v!r} for sample {i} (prompt {s.prompt!r}); a reward is a "
                    f"number or a dict with the number under {key!r} ({NOT_A_REWARD})"
                ) from None
            if not math.isfinite(x):
                raise ValueError(
                    f"{self.who} returned {x} for sample {i} (prompt {s.prompt!r}, response {s.response!r}); "
                    "rewards must be finite"
                )
        raise AssertionError("unreachable: a failed conversion names its sample")


_MISSING = object()


def _number(v) -> float:
    if v is _MISSING or v is None:
        raise TypeError("no reward")
    return reward_number(v)  # a bool or a string is refused, not coerced
