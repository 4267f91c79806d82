"""The default generate function: a rollout's samples in one engine call per engine.

Without ``--custom-generate-function-path`` this is what turns a batch of prompt records into
``Sample``s (the user's hook takes its place otherwise; both end in the same scoring and
flattening, ``manager.RolloutManager``). Every prompt is tokenised once and repeated ``n`` times
(a prompt's samples are contiguous and form one group); the groups are cut into contiguous shares
(``group_shares``), one per engine, generated concurrently and gathered back in group order. Each
share carries the index of its first sample in the rollout (``first_sample``), so
per-sample-seeded engines (vllm, sglang) sample the same tokens however many engines there are;
the ``hf`` engine in the manager's process gets the whole batch in one call.

The engines answer with ``Generation``s (the engine boundary: engines know no ``Sample``); they
become ``Sample``s here (``build_samples``), once per rollout, with what the flattener
(``flatten.flatten_samples``) and the reward read: ``tokens`` = the engine's prompt +
response ids, ``response``, ``rollout_log_probs``, ``rollout_routed_experts``, ``weight_versions`` and the status
(``TRUNCATED`` when the response did not end on a stop id). ``sample.prompt`` is slime's: the
record's prompt after the chat template with ``--apply-chat-template`` (the text whose ids the
engine got, ``--system-prompt`` and ``--apply-chat-template-kwargs`` included), the string itself
without (``tokenizer.prompt_text``), the same form a generate hook's samples carry
(``hooks.fresh_samples``), so one reward function sees one form in both paths.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, List, Optional, Sequence

from rl_plugin.rollout.engines.base import Generation, RolloutEngine, SamplingParams
from rl_plugin.rollout.sample import Sample

_RESPONSE_LENGTH = attrgetter("response_length")


def group_shares(num_groups: int, num_engines: int) -> List[int]:
    """Prompt groups per engine: as even as possible, the first engines taking the remainder."""
    base, extra = divmod(num_groups, num_engines)
    return [base + (1 if i < extra else 0) for i in range(num_engines)]


def build_samples(
    recs,
    gens: Sequence[Generation],
    responses: Sequence[str],
    n: int,
    prompts: Optional[Sequence[Any]] = None,
    first_group: int = 0,
) -> List[Sample]:
    """The rollout's ``Sample`` objects: group ``first_group + g`` is record ``g``'s ``n`` contiguous samples;
    ``tokens`` are the engine's prompt + response ids, the log-probs and routed experts the
    engine's lists (not copied); ``prompts[g]`` is group ``g``'s ``sample.prompt`` (default: the
    record's prompt as it is)."""
    prompts = [r.prompt for r in recs] if prompts is None else prompts
    done, cut = Sample.Status.COMPLETED, Sample.Status.TRUNCATED
    return [
        Sample(
            group_index=first_group + i // n,
            index=first_group * n + i,
            prompt=prompts[i // n],
            tokens=g.prompt_ids + g.response_ids,
            response=responses[i],
            response_length=len(g.response_ids),
            label=recs[i // n].label,
            rollout_log_probs=g.log_probs,
            rollout_routed_experts=g.routed_experts,
            weight_versions=g.weight_versions,  # a pausable generation's (fully async), else None
            metadata=dict(recs[i // n].metadata or {}),  # a copy per sample
            status=done if g.finished else cut,
        )
        for i, g in enumerate(gens)
    ]


def record_prompt(tokenizer, rec) -> List[int]:
    """A record's prompt ids: ``tokenizer.prompt_ids``, or with images (``--multimodal-keys``) the
    processor's ``ImagePrompt`` (``rollout.data.vl_prompt``: the ids carry the pixel values)."""
    if rec.images is None:
        return tokenizer.prompt_ids(rec.prompt)
    from rl_plugin.rollout.data.images import open_images

    return tokenizer.image_prompt(rec.prompt, open_images(rec.where, "images", rec.images))


def attach_images(samples: Sequence[Sample], prompts: Sequence[List[int]], n: int) -> None:
    """Each sample of group ``g`` gets ``prompts[g]``'s images (``Sample.multimodal_inputs``) and
    processed tensors (``multimodal_train_inputs``; shared by the group, never written)."""
    for i, s in enumerate(samples):
        p = prompts[i // n]
        if getattr(p, "pixel_values", None) is not None:
            s.multimodal_inputs = {"image": p.images}
            s.multimodal_train_inputs = {"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw}


def check_responses(samples: Sequence[Sample]) -> None:
    """An engine's empty response is a setting error (``--rollout-max-response-len`` 0), not a sample."""
    lengths = list(map(_RESPONSE_LENGTH, samples))  # one C-level pass, no Python loop over samples
    if lengths and min(lengths) == 0:
        empty = samples[lengths.index(0)]
        raise RuntimeError(
            f"rollout sample {empty.index} (prompt {empty.prompt!r}) has an empty response; check "
            "--rollout-max-response-len >= 1"
        )


class DefaultGenerate:
    """``generate(recs, n, seed)`` -> the ``n * len(recs)`` samples of those records (module
    docstring), on the in-process ``engine`` or the ``engine_actors``.

    Fully async (``rollout.fully_async.producer``) sets ``actor_call`` to the actors' pausable call and,
    with ``--rollout-submission-granularity sample``, ``on_generations_done``: ``actor_call`` then
    returns each actor's stream (``EngineActor.generate_stream``), consumed as the actors yield, and
    ``on_generations_done(indices, generations)`` gets every chunk at once, indices in the whole
    call (a group never spans two actors: the shares are whole groups)."""

    def __init__(
        self, tokenizer, params: SamplingParams, engine: Optional[RolloutEngine], engine_actors: Sequence[Any]
    ):
        self.tokenizer, self.params = tokenizer, params
        self.engine, self.engine_actors = engine, list(engine_actors)
        # (actor, prompts, params, seed, first_sample) -> ObjectRef (a stream with on_generations_done)
        self.actor_call = lambda actor, *call: actor.generate.remote(*call)
        self.on_generations_done: Optional[Callable[[List[int], List[Generation]], None]] = None

    def __call__(self, recs: Sequence, n: int, seed: int) -> List[Sample]:
        prompt_ids = [record_prompt(self.tokenizer, r) for r in recs]
        gens = self.generations([p for p in prompt_ids for _ in range(n)], n, seed=seed)
        samples = self.samples(recs, gens, n)
        attach_images(samples, prompt_ids, n)
        return samples

    def samples(self, recs: Sequence, gens: Sequence[Generation], n: int, first_group: int = 0) -> List[Sample]:
        """Groups ``first_group ..`` of a call: records ``recs``' ``Sample``s from their
        ``Generation``s (``n`` per record, in order), checked; the one way both a whole call and a
        group delivered early (fully async) become samples."""
        texts = [self.tokenizer.prompt_text(r.prompt) for r in recs]  # sample.prompt (module docstring)
        responses = [self.tokenizer.decode(g.response_ids) for g in gens]
        samples = build_samples(recs, gens, responses, n, prompts=texts, first_group=first_group)
        check_responses(samples)
        return samples

    def generations(self, prompts: List[List[int]], n: int, *, seed: int) -> List[Generation]:
        """All samples (``n`` per group, groups contiguous), spread over the engines by whole
        groups and gathered in order."""
        if self.engine is not None:
            return self.engine.generate(prompts, self.params, seed=seed)
        import ray

        refs, starts, start = [], [], 0
        for actor, groups in zip(self.engine_actors, group_shares(len(prompts) // n, len(self.engine_actors))):
            if groups:
                refs.append(self.actor_call(actor, prompts[start : start + groups * n], self.params, seed, start))
                starts.append(start)
            start += groups * n
        if self.on_generations_done is None:
            return [g for part in ray.get(refs) for g in part]
        return self._streamed(refs, starts, len(prompts))

    def _streamed(self, streams: List[Any], starts: List[int], total: int) -> List[Generation]:
        """The actors' streams consumed as their chunks arrive (whichever actor is first); each
        chunk goes to ``on_generations_done`` at once, then into its place of the whole call."""
        import ray

        out: List[Optional[Generation]] = [None] * total
        live = list(zip(streams, starts))
        while live:
            ready, _ = ray.wait([s for s, _ in live], num_returns=1)
            at = next(k for k, (s, _) in enumerate(live) if s is ready[0])
            stream, start = live[at]
            try:
                idx, gens = ray.get(next(stream))
            except StopIteration:
                del live[at]
                continue
            idx = [start + i for i in idx]
            for i, g in zip(idx, gens):
                out[i] = g
            if idx:
                self.on_generations_done(idx, gens)
        missing = [i for i, g in enumerate(out) if g is None]
        if missing:
            raise RuntimeError(f"engine streams ended without samples {missing[:5]} of {total}")
        return out  # type: ignore[return-value]
