"""slime's rollout hooks, run by the rollout manager.

``--custom-generate-function-path`` (slime's ``custom_generate_function_path``): per sample,

    async def generate(args, sample: Sample, sampling_params: dict) -> Sample

``sample`` arrives with ``prompt`` (slime's: the text after the chat template with
``--apply-chat-template``, the string itself without; the default path's samples carry the same,
so the reward sees one form), ``tokens`` (the
prompt ids, ``response_length`` 0), ``label``, ``metadata`` (a copy of the record's), ``index`` and
``group_index``; the hook generates with ``rl_plugin.rollout.generate_tokens`` (as often as it
likes, calling tools between turns), appends the response ids to ``tokens`` and sets
``response_length``, ``loss_mask`` (0 for ids it did not sample: tool output), ``rollout_log_probs``
(0.0 for those), ``status`` and, for the metrics, ``metadata["turns"]`` (model turns) and
``metadata["tool_calls"]``. All samples of a rollout run concurrently as asyncio tasks (a plain
``def`` works too); their requests reach the engines in batches (``generate.EngineRouter``).
With images (``--multimodal-keys``) the sample also carries its prompt's images (``tokens``
expanded, ``multimodal_inputs`` / ``multimodal_train_inputs``); ``append_image`` adds one in a
later turn and ``generate_tokens(..., sample=sample)`` sends them all (``rollout.vl_turns``).

``--rollout-function-path`` (slime's ``rollout_function_path``) replaces the whole rollout:

    [async] def generate_rollout(args, rollout_id, data_source, evaluation=False) -> list[list[Sample]]

``data_source.get_samples(k)`` hands out the next k prompt groups (``--n-samples-per-prompt``
fresh samples each, filled in as above); the function returns ``--rollout-batch-size`` groups of
``--n-samples-per-prompt`` samples (or an object whose ``samples`` holds them, as slime's
``RolloutFnTrainOutput``), each sample filled in as a generate hook fills it. It can call
``generate_tokens`` (an ``async def`` in the manager's event loop; a plain ``def`` through its own
``asyncio.run``). The samples are then scored by the run's reward, as a hook's are. Evaluation
(``--eval-interval``) keeps the plain rollout (or the generate hook, when one is set).

What the hooks return is checked (``sample_check``: the contract, the same object twice, the
limits) and flattened into ``RolloutData`` with its per-token loss mask. An exception in a hook is
re-raised naming the flag, the hook's file:line and the sample; so is a sample past
``--custom-generate-timeout`` and a rollout past ``--rollout-function-timeout`` (``deadlines``:
an ``async def`` is cancelled, a plain ``def`` runs in a worker thread, left behind when stuck).
``generate_tokens``' ``max_new_tokens`` is clamped to the flag and the model's context
(``generate.EngineRouter.clamp``).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

from rl_plugin.configs.custom_generation import DEFAULT_GENERATE_TIMEOUT_S, DEFAULT_ROLLOUT_FUNCTION_TIMEOUT_S
from rl_plugin.rollout import abort
from rl_plugin.rollout.deadlines import SerialWorker, UserCallTimeout, call_with_deadline
from rl_plugin.rollout.engines.base import Generation, SamplingParams
from rl_plugin.rollout.generate import Dispatch, EngineRouter
from rl_plugin.rollout.generation.default import attach_images, record_prompt
from rl_plugin.rollout.sample import Sample
from rl_plugin.rollout.sample_check import describe_sample
from rl_plugin.user_code import describe_exception, load_function, where

GENERATE_FLAG = "--custom-generate-function-path"
ROLLOUT_FLAG = "--rollout-function-path"


class HookError(RuntimeError):
    """A rollout hook raised; the message names the flag, the hook's file:line and the sample."""


class Hook:
    """A user function named by ``flag``, with where it came from (for messages)."""

    def __init__(self, fn: Callable, flag: str, spec: str):
        self.fn, self.flag, self.spec = fn, flag, spec
        self.worker = SerialWorker(f"rl_plugin-hook-{flag.strip('-')}")  # a plain def's calls (``deadlines``)

    @classmethod
    def load(cls, spec: str, flag: str) -> "Hook":
        return cls(load_function(spec, flag), flag, spec)

    def describe(self) -> str:
        return f"{self.flag} {self.spec} ({getattr(self.fn, '__qualname__', '?')} at {where(self.fn)})"

    def source(self) -> Optional[str]:
        try:
            return inspect.getsourcefile(inspect.unwrap(self.fn))
        except TypeError:
            return None


def engine_dispatch(engine, engine_actors: Sequence[Any]) -> Dispatch:
    """One batch of ``generate_tokens`` requests on the run's engines: the in-process ``engine``
    in a worker thread (the hooks' event loop stays free for their tools), or contiguous shares
    over the ``engine_actors``, one call each, awaited together and gathered in order."""

    async def dispatch(prompts: List[List[int]], params: SamplingParams, seed: int) -> List[Generation]:
        if engine is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, lambda: engine.generate(prompts, params, seed=seed))
        base, extra = divmod(len(prompts), len(engine_actors))
        refs, start = [], 0
        for i, actor in enumerate(engine_actors):
            count = base + (1 if i < extra else 0)
            if count:
                refs.append(actor.generate.remote(prompts[start : start + count], params, seed, start))
            start += count
        return [g for part in await asyncio.gather(*refs) for g in part]

    return dispatch


def default_sampling_params(params: SamplingParams) -> Dict[str, Any]:
    """The ``sampling_params`` a generate hook receives (slime's keys, the run's flags)."""
    return {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "stop_token_ids": [],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def fresh_samples(tokenizer, recs: Sequence, n: int, first_group: int = 0) -> List[Sample]:
    """``n`` samples per record (groups contiguous), filled in for a hook (module docstring); a
    record's images (``--multimodal-keys``) in ``tokens`` (expanded) and ``multimodal_inputs`` /
    ``multimodal_train_inputs``, as the default generation gives them."""
    out = []
    prompts = [record_prompt(tokenizer, r) for r in recs]
    for g, r in enumerate(recs):
        text, ids = tokenizer.prompt_text(r.prompt), prompts[g]
        for j in range(n):
            out.append(
                Sample(
                    group_index=first_group + g,
                    index=(first_group + g) * n + j,
                    prompt=text,
                    tokens=list(ids),
                    label=r.label,
                    metadata=dict(r.metadata or {}),
                )
            )
    attach_images(out, prompts, n)
    return out


def run_generate_hook(
    hook: Hook,
    hook_args,
    samples: List[Sample],
    sampling_params: Dict[str, Any],
    dispatch: Dispatch,
    seed: int,
    defaults: SamplingParams,
    *,
    timeout: Optional[float] = None,
    context_len: Optional[int] = None,
    vocab_size: Optional[int] = None,
    prompts=None,
) -> List[Any]:
    """Every sample through the hook, concurrently (one event loop), each within ``timeout``
    seconds (``--custom-generate-timeout``; None: ``DEFAULT_GENERATE_TIMEOUT_S``); the hooks'
    return values. ``context_len``: the model's context, ``generate_tokens``' bound (with
    ``defaults.max_new_tokens``); ``vocab_size``: the bound of the ids it is asked for;
    ``prompts``: the run's prompt tokenizer (with images its processor: ``rollout.vl_turns``)."""
    source = hook.source()
    timeout = DEFAULT_GENERATE_TIMEOUT_S if timeout is None else timeout

    async def one(i: int, sample: Sample):
        try:
            return await call_with_deadline(
                hook.fn,
                hook_args,
                sample,
                dict(sampling_params),
                timeout=timeout,
                what="--custom-generate-timeout",
                worker=hook.worker,
            )
        except abort.GenerationAborted:
            raise
        except UserCallTimeout as exc:
            raise HookError(
                f"{hook.describe()} {exc} on {describe_sample(sample, i)}. Fix: give the hook's tools (and its other "
                "waits) their own timeouts, or raise --custom-generate-timeout if such a sample legitimately takes longer"
            ) from None
        except Exception as exc:  # noqa: BLE001 - re-raised naming the hook and the sample
            raise HookError(
                f"{hook.describe()} raised on sample {i} (group {sample.group_index}): {describe_exception(exc, source)}"
            ) from exc

    async def main():
        EngineRouter(dispatch, seed, defaults, context_len, vocab_size, prompts).bind()
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))

    return abort.run(main(), f"the generate hook {hook.describe()}")


class DataSource:
    """slime's ``data_source`` for a ``--rollout-function-path`` function: ``get_samples(k)``,
    the next k prompt groups as fresh samples."""

    def __init__(self, next_batch: Callable[[int], list], tokenizer, n: int):
        self.next_batch, self.tokenizer, self.n = next_batch, tokenizer, n
        self.groups_given = 0

    def get_samples(self, num_groups: int) -> List[List[Sample]]:
        flat = fresh_samples(self.tokenizer, self.next_batch(int(num_groups)), self.n, self.groups_given)
        self.groups_given += int(num_groups)
        return [flat[g * self.n : (g + 1) * self.n] for g in range(int(num_groups))]


def run_rollout_function(
    hook: Hook,
    hook_args,
    rollout_id: int,
    data_source: DataSource,
    dispatch: Dispatch,
    seed: int,
    defaults: SamplingParams,
    evaluation: bool = False,
    *,
    timeout: Optional[float] = None,
    context_len: Optional[int] = None,
    vocab_size: Optional[int] = None,
    prompts=None,
) -> List[List[Sample]]:
    """The whole rollout from the user's function (module docstring), within ``timeout`` seconds
    (``--rollout-function-timeout``; None: ``DEFAULT_ROLLOUT_FUNCTION_TIMEOUT_S``): its groups."""
    timeout = DEFAULT_ROLLOUT_FUNCTION_TIMEOUT_S if timeout is None else timeout
    token = EngineRouter(dispatch, seed, defaults, context_len, vocab_size, prompts).bind()
    what = "--rollout-function-timeout"
    try:
        label = f"the rollout function {hook.describe()}"  # what an abort names
        if inspect.iscoroutinefunction(inspect.unwrap(hook.fn)):

            async def whole():
                return await hook.fn(hook_args, rollout_id, data_source, evaluation=evaluation)

            out = abort.run(call_with_deadline(whole, timeout=timeout, what=what, worker=hook.worker), label)
        else:  # a plain def runs its own event loops (asyncio.run) in the worker thread
            with abort.phase(label):
                out = hook.worker.call(
                    hook.fn, hook_args, rollout_id, data_source, evaluation=evaluation, timeout=timeout, what=what
                )
    except abort.GenerationAborted:
        raise
    except UserCallTimeout as exc:
        raise HookError(
            f"{hook.describe()} {exc} on rollout {rollout_id} ({data_source.groups_given} prompt groups taken from "
            "data_source so far). Fix: give its tools (and its other waits) their own timeouts, or raise "
            "--rollout-function-timeout if a rollout legitimately takes longer"
        ) from None
    except Exception as exc:  # noqa: BLE001 - re-raised naming the function
        raise HookError(
            f"{hook.describe()} raised on rollout {rollout_id}: {describe_exception(exc, hook.source())}"
        ) from exc
    finally:
        token.var.reset(token)
    groups = getattr(out, "samples", out)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise HookError(
            f"{hook.describe()} returned {type(groups).__name__} for rollout {rollout_id}; it must return a list of "
            "prompt groups, each a list of Samples (list[list[Sample]])"
        )
    return [list(g) for g in groups]


def check_groups(groups: List[List[Any]], want: int, n: int, hook: Hook, rollout_id: int) -> List[Any]:
    """The groups flattened, after checking there are ``want`` of ``n`` samples each."""
    sizes = [len(g) for g in groups]
    if len(groups) != want or any(s != n for s in sizes):
        raise HookError(
            f"{hook.describe()} returned {len(groups)} groups of sizes {sizes[:8]}{'...' if len(sizes) > 8 else ''} for "
            f"rollout {rollout_id}; the trainer needs --rollout-batch-size {want} groups of --n-samples-per-prompt {n}"
        )
    return [s for g in groups for s in g]


def multi_turn_stats(samples: Sequence[Sample], loss_mask_sum: float, response_tokens: int) -> Dict[str, float]:
    """``multi_turn/turns_mean`` and ``multi_turn/tool_calls_mean`` (means of the hooks'
    ``metadata["turns"]`` / ``metadata["tool_calls"]`` over the samples that set them; absent when
    none does), ``multi_turn/masked_token_frac`` (response tokens with loss mask 0 / response
    tokens) and ``multi_turn/model_tokens`` (the loss mask's sum: the rollout's trained tokens, what
    the steps' ``tokens`` metrics add up to)."""
    out = {
        "multi_turn/masked_token_frac": 1.0 - loss_mask_sum / max(response_tokens, 1),
        "multi_turn/model_tokens": float(loss_mask_sum),
    }
    for key, name in (("turns", "multi_turn/turns_mean"), ("tool_calls", "multi_turn/tool_calls_mean")):
        values = [float(s.metadata[key]) for s in samples if key in s.metadata]
        if values:
            out[name] = sum(values) / len(values)
    return out
