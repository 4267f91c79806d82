"""``generate_tokens``: one generation on the run's engines, from inside a custom rollout hook.

A ``--custom-generate-function-path`` hook (or a ``--rollout-function-path`` function) runs as
many asyncio tasks, one per sample; each ``await generate_tokens(args, input_ids, sampling_params)``
is one request. Token in, token out: ``input_ids`` are the ids to condition on (prompt, earlier
turns, tool output), the answer is

    {"output_ids": [int], "output_log_probs": [float], "finish_reason": "stop" | "length"}

one log-prob per output id (and, under ``--fully-async``, ``output_weight_versions``: the weight
version of each, which a hook may keep in ``sample.weight_versions``; tokens it leaves unversioned
count as the oldest version of their submission), what the engine returns for a plain rollout (the log-prob under the
distribution the token was drawn from, at the request's temperature); "stop" when the response
ends on an EOS id or one of ``stop_token_ids`` (that id is the last output id), "length" when it
hit ``max_new_tokens``.

``sampling_params`` is a dict in SGLang's spelling, as slime passes it: ``max_new_tokens``,
``temperature``, ``top_p``, ``top_k`` (-1: none), ``stop_token_ids`` (besides EOS); an absent key
takes the run's flag (``--rollout-max-response-len``, ``--rollout-temperature``,
``--rollout-top-p``; the router's ``defaults``). ``args`` is accepted for slime's signature and
not read. SGLang's detokenisation switches (``skip_special_tokens``,
``no_stop_trim``, ``spaces_between_special_tokens``) change nothing here (no text is produced) and
are accepted; any other key, and a non-empty ``stop`` (stop *strings*: the engines stop on ids),
is refused naming the key.

Batching (``EngineRouter``): a request is queued and the queue is flushed when the event loop
has run every task that was ready, so the requests that arrive together (every sample's first
turn, then every second turn that the same engine call made ready) go out as one engine call per
distinct sampling setting, cut into contiguous shares over the engines (one call per engine).
While a call is in flight, new requests queue for the next flush. A flush's requests with
different ``max_new_tokens`` share one call at the largest and each answer is cut to its own
limit (a cut answer is "length"): the first k tokens of an autoregressive sample are a sample of
k tokens. Every flush is seeded ``seed_of(rollout seed, flush index)``: the same hooks on the same
weights sample the same tokens, so a restarted rollout regenerates what the lost one would have.

Images (``--multimodal-keys``): ``generate_tokens(args, sample.tokens, sampling_params,
sample=sample)`` sends the hook's sample's images with the ids (``rollout.vl_turns``: the prompt's
and those ``append_image`` added, each at its image tokens); image tokens without ``sample=`` are
refused (the engine would see the pads and not the images).

Limits (``EngineRouter.clamp``): ``max_new_tokens`` is clamped to ``--rollout-max-response-len``
(the router's ``defaults``) and to the room the model's context leaves after ``input_ids``
(``max_position_embeddings - len(input_ids)``), before any engine sees it, so every engine
generates the same number of tokens (the ``hf`` engine would generate past the context, vLLM
caps silently). Each kind of clamp prints one line per run, not one per call. ``input_ids`` that
already fill the context are refused (``ValueError``: nothing can be generated), and so is an id
of ``input_ids`` or ``stop_token_ids`` outside the model's vocabulary (``vocab_size``), before any
engine sees it; the hook's error then names the sample. A request whose
room is below the flag gets its own engine call (a shared call generates up to its longest
request), so no engine runs past the context.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
from dataclasses import replace
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

from rl_plugin.rollout.engines.base import Generation, SamplingParams
from rl_plugin.rollout.vl_turns import RUN_PROMPTS, image_request

# the router of the rollout being generated (set by ``EngineRouter.bind`` in the rollout's event loop)
_ROUTER: contextvars.ContextVar[Optional["EngineRouter"]] = contextvars.ContextVar("rl_plugin_router", default=None)

# SGLang keys that only shape the detokenised text (none is produced here): accepted, no effect
TEXT_ONLY_KEYS = frozenset({"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"})
KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop"}) | TEXT_ONLY_KEYS

DEFAULTS = SamplingParams()  # an engine's defaults when a router is given none

_SAID: set = set()  # the clamps already reported in this process (one line per run each)


def _say_once(key: str, line: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        print(f"generate_tokens: {line} (said once per run)", flush=True)


# dispatch(prompts, params, seed) -> one Generation per prompt, in order (the manager's engines)
Dispatch = Callable[[List[List[int]], SamplingParams, int], Awaitable[List[Generation]]]


def seed_of(seed: int, flush: int) -> int:
    """The engine seed of flush ``flush`` of a rollout seeded ``seed`` (a 62-bit hash)."""
    digest = hashlib.blake2b(f"{int(seed)}/flush/{int(flush)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def sampling_params_of(
    sampling_params: Optional[Dict[str, Any]], defaults: SamplingParams = DEFAULTS
) -> SamplingParams:
    """The engine's ``SamplingParams`` of an SGLang-style dict, absent keys from ``defaults`` (the
    run's flags, module docstring); a bad key or value raises ``ValueError`` naming it."""
    sp = dict(sampling_params or {})
    unknown = sorted(set(sp) - KEYS)
    if unknown:
        raise ValueError(
            f"generate_tokens: sampling_params has unknown key(s) {unknown}; accepted: {sorted(KEYS)} (SGLang's spelling)"
        )
    if sp.get("stop"):
        raise ValueError(
            f"generate_tokens: sampling_params['stop'] = {sp['stop']!r}: stop strings are not supported (the engines "
            "stop on ids); pass stop_token_ids, or cut the output where the text ends in the hook"
        )
    max_new = sp.get("max_new_tokens", defaults.max_new_tokens)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"generate_tokens: max_new_tokens must be an int >= 1, got {max_new!r}")
    temperature = float(sp.get("temperature", defaults.temperature))
    top_p = float(sp.get("top_p", defaults.top_p))
    top_k = int(sp.get("top_k", defaults.top_k))
    if not temperature > 0:
        raise ValueError(f"generate_tokens: temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate_tokens: top_p must be in (0, 1], got {top_p}")
    stop = sp.get("stop_token_ids") or ()
    if isinstance(stop, int) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise ValueError(f"generate_tokens: stop_token_ids must be a list of ints, got {stop!r}")
    return SamplingParams(temperature, top_p, int(max_new), top_k, tuple(sorted(set(stop))))


def _check_ids(input_ids, vocab_size: Optional[int] = None) -> List[int]:
    """``input_ids`` as a list of ints in ``[0, vocab_size)`` (``ValueError`` naming the first
    that is not: an id past the embedding fails every request batched with it, and on a GPU
    poisons the engine with a device-side assert)."""
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    if not ids:
        raise ValueError("generate_tokens: input_ids is empty; a generation needs at least one token to condition on")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
    if bad is not None:
        raise ValueError(f"generate_tokens: input_ids holds {bad!r} ({type(bad).__name__}); expected ids >= 0")
    if vocab_size is not None and max(ids) >= vocab_size:
        at = next(k for k, t in enumerate(ids) if t >= vocab_size)
        raise ValueError(
            f"generate_tokens: input_ids[{at}] = {ids[at]} is outside the model's vocabulary [0, {vocab_size}); "
            "pass ids the model's tokenizer produced"
        )
    return ids


def current_router(what: str = "generate_tokens") -> "EngineRouter":
    """The running rollout's router (``RuntimeError`` naming ``what`` outside a rollout)."""
    router = _ROUTER.get()
    if router is None:
        raise RuntimeError(
            f"{what} runs inside a rollout: call it from a --custom-generate-function-path hook or a "
            "--rollout-function-path function, which the rollout manager runs with its engines"
        )
    return router


def _with_images(router: "EngineRouter", ids: List[int], sample) -> List[int]:
    """``ids`` as the engine's request: with images (a run with ``--multimodal-keys``) the sample's
    ``ImagePrompt`` (``rollout.vl_turns``: every image so far at its image tokens)."""
    processor = getattr(router.prompts, "processor", None)
    if processor is None:
        return ids
    image_id = processor.image_token_id
    if sample is None:
        if image_id in ids:
            raise ValueError(
                "generate_tokens: input_ids hold image tokens and no images reach the engine; pass the hook's sample "
                "(generate_tokens(args, sample.tokens, sampling_params, sample=sample)) so the model sees its images"
            )
        return ids
    return image_request(sample, ids, image_id)


async def generate_tokens(
    args, input_ids: Sequence[int], sampling_params: Optional[Dict[str, Any]] = None, *, sample=None
) -> Dict[str, Any]:
    """One generation on the run's engines (module docstring): ``output_ids``,
    ``output_log_probs``, ``finish_reason``. Only inside a rollout: a custom generate hook or a
    ``--rollout-function-path`` function that the rollout manager runs. ``sample``: the hook's
    ``Sample`` in a run with images: the engine gets its images (``rollout.vl_turns``;
    ``input_ids`` then start with ``sample.tokens``)."""
    router = current_router()
    ids = _with_images(router, _check_ids(input_ids, router.vocab_size), sample)
    params = router.clamp(ids, sampling_params_of(sampling_params, router.defaults))
    stop = [t for t in params.stop_token_ids if router.vocab_size is not None and t >= router.vocab_size]
    if stop:
        raise ValueError(
            f"generate_tokens: stop_token_ids holds {stop[0]}, outside the model's vocabulary [0, {router.vocab_size})"
        )
    gen = await router.submit(ids, params)
    out = {
        "output_ids": list(gen.response_ids),
        "output_log_probs": list(gen.log_probs),
        "finish_reason": "stop" if gen.finished else "length",
    }
    if gen.weight_versions is not None:  # --fully-async: a hook may keep them as sample.weight_versions
        out["output_weight_versions"] = list(gen.weight_versions)
    return out


def cut(gen: Generation, max_new_tokens: int) -> Generation:
    """``gen`` limited to ``max_new_tokens`` output ids (a cut answer did not stop: "length")."""
    if len(gen.response_ids) <= max_new_tokens:
        return gen
    versions = gen.weight_versions[:max_new_tokens] if gen.weight_versions is not None else None
    return Generation(
        gen.prompt_ids, gen.response_ids[:max_new_tokens], gen.log_probs[:max_new_tokens], False, None, versions
    )


class EngineRouter:
    """Queues ``generate_tokens`` requests and sends them to the engines in batches (module
    docstring). One per rollout, used from one event loop; ``calls`` counts the engine calls."""

    def __init__(
        self,
        dispatch: Dispatch,
        seed: int,
        defaults: SamplingParams = DEFAULTS,
        context_len: Optional[int] = None,
        vocab_size: Optional[int] = None,
        prompts=None,
    ):
        self.dispatch, self.seed, self.defaults = dispatch, int(seed), defaults
        self.prompts = prompts  # the run's prompt tokenizer (with images: ``VLPrompts``, its processor)
        self.context_len = context_len  # the model's max_position_embeddings (None: unknown, no clamp)
        self.vocab_size = vocab_size  # the model's vocabulary: the bound of every id asked (None: unchecked)
        self.queue: List[Tuple[List[int], SamplingParams, asyncio.Future]] = []
        self.flushes = self.calls = self.requests = 0
        self.busy = False
        self.scheduled = False

    def bind(self) -> contextvars.Token:
        """Make this router the one ``generate_tokens`` uses in the current context (tasks
        created afterwards inherit it), and its ``prompts`` the ones ``append_image`` reads."""
        RUN_PROMPTS.set(self.prompts)
        return _ROUTER.set(self)

    def clamp(self, ids: List[int], params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_new_tokens`` at most ``--rollout-max-response-len`` and the room
        the context leaves after ``ids`` (module docstring)."""
        flag_max, asked = int(self.defaults.max_new_tokens), int(params.max_new_tokens)
        new = min(asked, flag_max)
        if new < asked:
            _say_once(
                "flag",
                f"max_new_tokens={asked} clamped to {new} (--rollout-max-response-len); raise the flag to generate more",
            )
        if self.context_len is not None:
            room = int(self.context_len) - len(ids)
            if room < 1:
                raise ValueError(
                    f"generate_tokens: input_ids hold {len(ids)} ids, the model's whole context "
                    f"(max_position_embeddings {self.context_len}): nothing can be generated; end the conversation "
                    "before it fills the context"
                )
            if room < new:
                _say_once(
                    "context",
                    f"max_new_tokens={new} clamped to {room} for input_ids of {len(ids)} ids (the model's context: "
                    f"max_position_embeddings {self.context_len})",
                )
                new = room
        return params if new == params.max_new_tokens else replace(params, max_new_tokens=new)

    def _near_context(self, ids: List[int]) -> bool:
        """True when ``ids`` leave less room than the flag's tokens (such a request gets its own call)."""
        return self.context_len is not None and len(ids) + int(self.defaults.max_new_tokens) > int(self.context_len)

    def submit(self, ids: List[int], params: SamplingParams) -> "asyncio.Future[Generation]":
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue.append((ids, params, fut))
        self.requests += 1
        self._schedule()
        return fut

    def _schedule(self) -> None:
        if not self.busy and not self.scheduled and self.queue:
            self.scheduled = True
            # after every task made ready before this point has run (and queued its request)
            asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self.scheduled = False
        if self.busy or not self.queue:
            return
        batch, self.queue = self.queue, []
        self.busy = True
        asyncio.get_running_loop().create_task(self._flush(batch))

    async def _flush(self, batch) -> None:
        seed = seed_of(self.seed, self.flushes)
        self.flushes += 1
        try:
            groups: Dict[SamplingParams, List[int]] = {}
            for i, (ids, params, _) in enumerate(batch):
                # near the context: a call of its own length (module docstring); else any length up to the flag
                own = params.max_new_tokens if self._near_context(ids) else 0
                key = SamplingParams(params.temperature, params.top_p, own, params.top_k, params.stop_token_ids)
                groups.setdefault(key, []).append(i)
            for g, (key, idx) in enumerate(groups.items()):
                longest = max(batch[i][1].max_new_tokens for i in idx)
                params = SamplingParams(key.temperature, key.top_p, longest, key.top_k, key.stop_token_ids)
                self.calls += 1
                try:
                    gens = await self.dispatch([batch[i][0] for i in idx], params, seed + g)
                except Exception as exc:  # noqa: BLE001 - every waiting request gets the engine's error
                    for i in idx:
                        if not batch[i][2].done():
                            batch[i][2].set_exception(exc)
                    continue
                for i, gen in zip(idx, gens):
                    if not batch[i][2].done():
                        batch[i][2].set_result(cut(gen, batch[i][1].max_new_tokens))
        finally:
            self.busy = False
            self._schedule()
