"""The fully-async rollout worker (``--fully-async``): a background thread of the rollout manager.

It generates without waiting for the trainer, in submissions of ``max_concurrent // n`` prompt
groups (``--async-max-concurrent-samples``, n = ``--n-samples-per-prompt``), each seeded
``seed + ASYNC_SEED_OFFSET + submission index``:

1. the prompts (``PromptQueue``): first those re-queued (``--async-unused-samples-handler retry``, a
   resumed run's buffer), then the dataset's next ones;
2. the samples, on the engine behind the ``GenerationGate`` (``engines.pause``): a weight load or an
   eval of the manager runs at the next token boundary, and the requests in flight continue under
   the new weights (partial rollouts, ``--pause-generation-mode``); each response token keeps its
   version (``Sample.weight_versions``) beside its log-prob; engine actors pause their own
   generation for a load (``EngineActor.update_weights_paused``, their ``weights`` thread). A custom
   generate hook's samples carry the version at the submission's start for tokens the hook did not
   version (the oldest they can hold: a staleness never under-counted);
3. each finished group is scored, filtered (``--dynamic-sampling-filter-path``, at put time) and put
   into the ``AsyncBuffer``: with ``--rollout-submission-granularity sample`` as soon as its own
   samples finished (``_EarlyGroups``; never blocking the engine: a full buffer defers it to the
   end of the submission), with ``group`` when the whole submission finished. The in-process
   engine reports finished samples at its token boundaries (``GenerationGate.on_generations_done``);
   engine actors (vLLM, several hf engines) stream them (``EngineActor.generate_stream``, a Ray
   streaming generator the worker consumes as each actor yields, ``DefaultGenerate._streamed``).
   An early group's samples are built as the whole call's would be (same seeds, tokens, log-probs,
   versions, ``sample.prompt`` and index). A generate hook's groups are put when its submission ends.

An error in the thread (an abort included) closes the buffer; the trainer's next ``take`` raises it.

Every prompt taken from the queue is in exactly one place until a rollout takes its group: the
submission being generated (``generating``), the buffer, or the queue again (re-queued). One lock
(``lock``, the buffer's too) guards all three and the dataset position, so ``snapshot`` (what a
checkpoint saves) is one atomic read: a group leaves ``generating`` in the same step that puts it
into the buffer.

The worker reaches the rest of the rollout side only through public seams: the generation source
(``GenerationSource``: tokenizer, sampling params, scorer, filter, ``hook_generate``) and the
engine fleet (``EngineFleet``: the in-process engine or the engine actors).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional

from rl_plugin.configs.async_training import AsyncConfig
from rl_plugin.rollout.data.prompt_queue import PromptQueue
from rl_plugin.rollout.engines.pause import GenerationGate
from rl_plugin.rollout.fleet import EngineFleet
from rl_plugin.rollout.fully_async.buffer import AsyncBuffer, Group
from rl_plugin.rollout.generation.default import DefaultGenerate
from rl_plugin.rollout.generation.source import GenerationSource
from rl_plugin.rollout.sample import Sample

ASYNC_SEED_OFFSET = 5_000_011
# Benchmark switch (``benchmarks/async_loop.py``): "1" makes a weight load wait for the submission in
# flight (the gate held for the whole submission), i.e. fully async without partial rollouts.
NO_PARTIAL_ENV = "RL_PLUGIN_ASYNC_NO_PARTIAL"


class GatedEngine:
    """The in-process engine with every ``generate`` pausable behind ``gate``."""

    def __init__(self, engine, gate: GenerationGate):
        self.engine, self.gate = engine, gate

    def generate(self, prompts, params, *, seed: int, first_sample: int = 0):
        return self.engine.generate(prompts, params, seed=seed, first_sample=first_sample, gate=self.gate)


def versions_of(samples: List[Sample]) -> List[List[int]]:
    return [s.weight_versions or [] for s in samples]


class AsyncProducer:
    def __init__(
        self,
        gen: GenerationSource,
        fleet: EngineFleet,
        prompts: PromptQueue,
        settings: AsyncConfig,
        version: int,
    ):
        """``version``: the trainer weight version the engines hold now (the tokens drawn before the
        next load carry it)."""
        self.gen, self.fleet, self.prompts, self.settings = gen, fleet, prompts, settings
        self.n = int(gen.config.n_samples_per_prompt)
        self.gate = GenerationGate(settings.pause_generation_mode, version)
        # the queue, the dataset position, ``generating`` and the buffer's groups (module docstring)
        self.lock = threading.RLock()
        rbs = int(gen.config.rollout_batch_size)
        self.concurrent = settings.concurrent(rbs, self.n)
        capacity = settings.capacity(rbs)
        self.buffer = AsyncBuffer(
            capacity, settings.max_weight_staleness, settings.async_unused_samples_handler, self.requeue, lock=self.lock
        )
        self.generating: List[Any] = []  # the records of the submission being generated, not yet delivered
        self.submissions = 0
        self.generated_groups = 0
        self.filtered_groups = 0
        self.error: Optional[BaseException] = None
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rl_plugin-async-rollout", daemon=True)
        self.thread.start()

    # -- what the manager's thread calls --------------------------------------------------------
    def requeue(self, record: Any) -> None:
        """``record``'s prompt generated again (a group the buffer dropped as stale, ``retry``)."""
        with self.lock:
            self.prompts.requeue(record)

    def snapshot(self) -> Dict[str, Any]:
        """The dataset position and every prompt taken from it but not in a rollout yet
        (re-queued, being generated, buffered: ``async_requeue``), read in one step."""
        with self.lock:
            return self.prompts.state_dict(pending=self.generating + self.buffer.records())

    def samples_in_flight(self) -> int:
        """Trajectories of the submission being generated, not yet delivered."""
        with self.lock:
            return len(self.generating) * self.n

    # -- the thread ------------------------------------------------------------------------------
    def stop(self, timeout: float = 60.0) -> None:
        """End the thread after its submission in flight (the buffer closed: a waiting put returns)."""
        self._stopping.set()
        self.buffer.close()
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._submission()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's next take
            if not self._stopping.is_set():
                self.error = exc
            self.buffer.close()

    def _records(self, groups: int) -> List[Any]:
        with self.lock:
            recs = self.prompts.next_batch(groups)
            self.generating = list(recs)  # a copy: delivered groups leave it
            return recs

    def _submission(self) -> None:
        gen, engine, n = self.gen, self.fleet.engine, self.n
        recs = self._records(max(1, self.concurrent // n))
        seed = gen.config.seed + ASYNC_SEED_OFFSET + self.submissions
        self.submissions += 1
        start = self.gate.version
        early = _EarlyGroups(self, recs) if self.settings.rollout_submission_granularity == "sample" else None
        if os.environ.get(NO_PARTIAL_ENV) == "1":
            samples = self._unpaused(recs, seed)
        elif gen.generate_hook is not None or engine is None:
            samples = self._whole(recs, seed, early)
        else:
            gated = GatedEngine(engine, self.gate)
            self.gate.on_generations_done = early
            try:
                samples = DefaultGenerate(gen.tokenizer, gen.params, gated, [])(recs, n, seed)
            finally:
                self.gate.on_generations_done = None
        for s in samples:
            if s.weight_versions is None or len(s.weight_versions) != s.response_length:
                s.weight_versions = [start] * s.response_length
        done = early.done if early is not None else set()
        for g in range(len(recs)):
            if g not in done:
                self.deliver(self.scored_group(recs[g], samples[g * n : (g + 1) * n]), block=True)
        for group in early.deferred if early is not None else []:
            self.deliver(group, block=True)
        with self.lock:
            self.generating = []

    def _unpaused(self, recs, seed: int) -> List[Sample]:
        """``NO_PARTIAL_ENV``: the submission generated with the gate held throughout (a load waits)."""
        gen, fleet = self.gen, self.fleet
        self.gate.enter()
        try:
            if gen.generate_hook is not None:
                return gen.hook_generate(recs, self.n, seed)
            return DefaultGenerate(gen.tokenizer, gen.params, fleet.engine, fleet.actors)(recs, self.n, seed)
        finally:
            self.gate.leave()

    def _whole(self, recs, seed: int, early: Optional["_EarlyGroups"]) -> List[Sample]:
        """A submission not generated by the in-process engine: a hook's (paused between engine
        calls; its groups put when the submission ends) or the engine actors' (each pausing its own
        generation for a load, ``EngineActor.generate_pausable``; with ``early``, their streams,
        ``EngineActor.generate_stream``, so a group leaves as soon as its samples finish)."""
        gen, fleet = self.gen, self.fleet
        if gen.generate_hook is not None and fleet.engine is not None:
            return gen.hook_generate(recs, self.n, seed, engine=GatedEngine(fleet.engine, self.gate))
        if gen.generate_hook is not None:  # engine actors: a load waits for the submission
            self.gate.enter()
            try:
                return gen.hook_generate(recs, self.n, seed)
            finally:
                self.gate.leave()
        default = DefaultGenerate(gen.tokenizer, gen.params, None, fleet.actors)
        # ``floor``: the version the actors hold at least (this submission's start: the fleet's true one)
        call = (self.settings.pause_generation_mode, self.gate.version)
        if early is None:
            default.actor_call = lambda a, *x: a.generate_pausable.remote(*x, *call)
        else:
            default.actor_call = lambda a, *x: a.generate_stream.remote(*x, *call)
            default.on_generations_done = early
        return default(recs, self.n, seed)

    def scored_group(self, rec, samples: List[Sample]) -> Optional[Group]:
        """The group scored and filtered (None: the dynamic-sampling filter dropped it)."""
        gen = self.gen
        rewards = gen.scorer.score_samples(samples, group_size=self.n)
        self.generated_groups += 1
        if gen.group_filter is not None and not gen.group_filter.keep(gen.config, samples):
            self.filtered_groups += 1
            self._landed(rec)
            return None
        versions = versions_of(samples)
        oldest = min((min(v) for v in versions if v), default=self.gate.version)
        partial = sum(1 for v in versions if v and min(v) != max(v))
        return Group(samples, [float(r) for r in rewards], rec, oldest, partial)

    def deliver(self, group: Optional[Group], block: bool) -> bool:
        """Put ``group`` into the buffer (``block``: waiting while it is full, the lock released
        meanwhile; else only if there is room) and take its prompt off ``generating`` in the same
        step (under the lock: a snapshot sees it in one place). None (filtered) does nothing."""
        if group is None:
            return True
        with self.lock:
            if block and not self.buffer.put(group):
                raise RuntimeError("the fully-async buffer was closed")
            if not block and not self.buffer.offer(group):
                return False
            self._landed(group.record)
        return True

    def _landed(self, rec) -> None:
        """``rec``'s group left the submission being generated (buffered or filtered)."""
        with self.lock:
            at = next((i for i, r in enumerate(self.generating) if r is rec), None)
            if at is not None:
                del self.generating[at]


class _EarlyGroups:
    """``--rollout-submission-granularity sample``: a submission's finished samples as the engine
    reports them (``GenerationGate.on_generations_done``: the in-process engine at a token boundary,
    the engine actors' streams as they yield; indices in the submission). A group whose ``n``
    samples are all in becomes samples exactly as the whole call's would
    (``DefaultGenerate.samples``), is scored, filtered and offered to the buffer; a full buffer
    defers it to the submission's end (never blocking the engine or a stream)."""

    def __init__(self, producer: "AsyncProducer", recs: List[Any]):
        self.p, self.recs = producer, recs
        self.build = DefaultGenerate(producer.gen.tokenizer, producer.gen.params, None, []).samples
        self.parts: Dict[int, List[Any]] = {}  # group -> its finished generations so far
        self.done: set = set()  # groups delivered, filtered or deferred here
        self.deferred: List[Group] = []

    def __call__(self, idx: List[int], gens) -> None:
        p, n = self.p, self.p.n
        for i, gen in zip(idx, gens):
            self.parts.setdefault(i // n, [None] * n)[i % n] = gen
        for g in [g for g, part in self.parts.items() if all(x is not None for x in part)]:
            part, rec = self.parts.pop(g), self.recs[g]
            self.done.add(g)
            samples = self.build([rec], part, n, first_group=g)
            group = p.scored_group(rec, samples)
            if group is not None and not p.deliver(group, block=False):
                self.deferred.append(group)
