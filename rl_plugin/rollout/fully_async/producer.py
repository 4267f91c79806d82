"""The fully-async rollout worker (``--fully-async``): a background thread of the rollout manager.

It generates without waiting for the trainer, in submissions of ``max_concurrent // n`` prompt
groups (``--async-max-concurrent-samples``, n = ``--n-samples-per-prompt``), each seeded
``seed + ASYNC_SEED_OFFSET + submission index``:

1. the prompts: first those re-queued (``--async-unused-samples-handler retry``, a resumed run's
   buffer), then the dataset's next ones;
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
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Deque, Dict, List, Optional

from rl_plugin.rollout.engines.pause import GenerationGate
from rl_plugin.rollout.fully_async.buffer import AsyncBuffer, Group
from rl_plugin.rollout.generation.default import DefaultGenerate
from rl_plugin.rollout.sample import Sample

ASYNC_SEED_OFFSET = 5_000_011
# Benchmark switch (``benchmarks/async_loop.py``): "1" makes a weight load wait for the submission in
# flight (the gate held for the whole submission), i.e. fully async without partial rollouts.
NO_PARTIAL_ENV = "RL_PLUGIN_ASYNC_NO_PARTIAL"


@dataclass(frozen=True)
class AsyncSettings:
    """What the worker reads of the fully-async flags (``configs.async_training``; built once by
    ``loop.config.LoopConfig``)."""

    max_concurrent: Optional[int]  # trajectories in flight (None: the rollout batch)
    granularity: str  # "sample" | "group"
    capacity_factor: float  # buffer capacity: ceil(factor x --rollout-batch-size) groups
    max_staleness: int
    handler: str  # "drop" | "retry"
    pause_mode: str  # "retract" | "in_place"

    def concurrent(self, rollout_batch_size: int, n: int) -> int:
        return int(self.max_concurrent or rollout_batch_size * n)

    def capacity(self, rollout_batch_size: int) -> int:
        return max(1, math.ceil(self.capacity_factor * rollout_batch_size))


class GatedEngine:
    """The in-process engine with every ``generate`` pausable behind ``gate``."""

    def __init__(self, engine, gate: GenerationGate):
        self.engine, self.gate = engine, gate

    def generate(self, prompts, params, *, seed: int, first_sample: int = 0):
        return self.engine.generate(prompts, params, seed=seed, first_sample=first_sample, gate=self.gate)


def versions_of(samples: List[Sample]) -> List[List[int]]:
    return [s.weight_versions or [] for s in samples]


class AsyncProducer:
    def __init__(self, manager, settings: AsyncSettings, version: int, requeued: Optional[List[Any]] = None):
        self.m, self.settings = manager, settings
        self.n = int(manager.config.n_samples_per_prompt)
        self.gate = GenerationGate(settings.pause_mode, version)
        self.retry: Deque[Any] = collections.deque(requeued or [])
        self.lock = threading.Lock()  # the dataset and the retry queue (the manager's thread reads them too)
        rbs = int(manager.config.rollout_batch_size)
        self.concurrent = settings.concurrent(rbs, self.n)
        self.buffer = AsyncBuffer(settings.capacity(rbs), settings.max_staleness, settings.handler, self.requeue)
        self.in_flight: List[Any] = []  # the records of the submission being generated
        self.submissions = 0
        self.generated_groups = 0
        self.filtered_groups = 0
        self.error: Optional[BaseException] = None
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rl_plugin-async-rollout", daemon=True)
        self.thread.start()

    # -- what the manager's thread calls --------------------------------------------------------
    def requeue(self, record: Any) -> None:
        with self.lock:
            self.retry.append(record)

    def pending_records(self) -> List[Any]:
        """Every prompt taken from the dataset but not trained on: re-queued, in flight, buffered."""
        with self.lock:
            return list(self.retry) + list(self.in_flight) + self.buffer.records()

    def inflight(self) -> int:
        with self.lock:
            return len(self.in_flight) * self.n

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
            recs = [self.retry.popleft() for _ in range(min(groups, len(self.retry)))]
            if len(recs) < groups:
                recs += self.m.train.next_batch(groups - len(recs))
            self.in_flight = list(recs)  # a copy: delivered groups leave it
            return recs

    def _submission(self) -> None:
        m, n = self.m, self.n
        recs = self._records(max(1, self.concurrent // n))
        seed = m.config.seed + ASYNC_SEED_OFFSET + self.submissions
        self.submissions += 1
        start = self.gate.version
        early = _EarlyGroups(self, recs) if self.settings.granularity == "sample" else None
        if os.environ.get(NO_PARTIAL_ENV) == "1":
            samples = self._unpaused(recs, seed)
        elif m.generate_hook is not None or m.engine is None:
            samples = self._whole(recs, seed, early)
        else:
            engine = GatedEngine(m.engine, self.gate)
            self.gate.on_generations_done = early
            try:
                samples = DefaultGenerate(m.tokenizer, m.params, engine, [])(recs, n, seed)
            finally:
                self.gate.on_generations_done = None
        for s in samples:
            if s.weight_versions is None or len(s.weight_versions) != s.response_length:
                s.weight_versions = [start] * s.response_length
        done = early.done if early is not None else set()
        for g in range(len(recs)):
            if g not in done:
                self._deliver(self._group(recs[g], samples[g * n : (g + 1) * n]), block=True)
        for group in early.deferred if early is not None else []:
            self._deliver(group, block=True)
        with self.lock:
            self.in_flight = []

    def _unpaused(self, recs, seed: int) -> List[Sample]:
        """``NO_PARTIAL_ENV``: the submission generated with the gate held throughout (a load waits)."""
        m = self.m
        self.gate.enter()
        try:
            if m.generate_hook is not None:
                return m._hook_generate(recs, self.n, seed)
            return DefaultGenerate(m.tokenizer, m.params, m.engine, m.engines)(recs, self.n, seed)
        finally:
            self.gate.leave()

    def _whole(self, recs, seed: int, early: Optional["_EarlyGroups"]) -> List[Sample]:
        """A submission not generated by the in-process engine: a hook's (paused between engine
        calls; its groups put when the submission ends) or the engine actors' (each pausing its own
        generation for a load, ``EngineActor.generate_pausable``; with ``early``, their streams,
        ``EngineActor.generate_stream``, so a group leaves as soon as its samples finish)."""
        m = self.m
        if m.generate_hook is not None and m.engine is not None:
            return m._hook_generate(recs, self.n, seed, engine=GatedEngine(m.engine, self.gate))
        if m.generate_hook is not None:  # engine actors: a load waits for the submission
            self.gate.enter()
            try:
                return m._hook_generate(recs, self.n, seed)
            finally:
                self.gate.leave()
        gen = DefaultGenerate(m.tokenizer, m.params, None, m.engines)
        call = (self.settings.pause_mode, self.gate.version)
        if early is None:
            gen.actor_call = lambda a, *x: a.generate_pausable.remote(*x, *call)
        else:
            gen.actor_call = lambda a, *x: a.generate_stream.remote(*x, *call)
            gen.on_generations_done = early
        return gen(recs, self.n, seed)

    def _group(self, rec, samples: List[Sample]) -> Optional[Group]:
        """The group scored and filtered (None: the dynamic-sampling filter dropped it)."""
        m = self.m
        rewards = m.scorer.score_samples(samples, group_size=self.n)
        self.generated_groups += 1
        if m.group_filter is not None and not m.group_filter.keep(m.config, samples):
            self.filtered_groups += 1
            self._landed(rec)
            return None
        versions = versions_of(samples)
        oldest = min((min(v) for v in versions if v), default=self.gate.version)
        partial = sum(1 for v in versions if v and min(v) != max(v))
        return Group(samples, [float(r) for r in rewards], rec, oldest, partial)

    def _deliver(self, group: Optional[Group], block: bool) -> bool:
        """Put ``group`` into the buffer (``block``: waiting while it is full; else only if there
        is room); its prompt is then no longer in flight. None (filtered) does nothing."""
        if group is None:
            return True
        if block and not self.buffer.put(group):
            raise RuntimeError("the fully-async buffer was closed")
        if not block and not self.buffer.offer(group):
            return False
        self._landed(group.record)
        return True

    def _landed(self, rec) -> None:
        """``rec``'s group left the submission in flight (buffered or filtered)."""
        with self.lock:
            at = next((i for i, r in enumerate(self.in_flight) if r is rec), None)
            if at is not None:
                del self.in_flight[at]


class _EarlyGroups:
    """``--rollout-submission-granularity sample``: a submission's finished samples as the engine
    reports them (``GenerationGate.on_generations_done``: the in-process engine at a token boundary,
    the engine actors' streams as they yield; indices in the submission). A group whose ``n``
    samples are all in becomes samples exactly as the whole call's would
    (``DefaultGenerate.samples``), is scored, filtered and offered to the buffer; a full buffer
    defers it to the submission's end (never blocking the engine or a stream)."""

    def __init__(self, producer: "AsyncProducer", recs: List[Any]):
        self.p, self.recs = producer, recs
        self.build = DefaultGenerate(producer.m.tokenizer, producer.m.params, None, []).samples
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
            group = p._group(rec, samples)
            if group is not None and not p._deliver(group, block=False):
                self.deferred.append(group)


def take_rollout(m, rollout_id: int, handle, settings: AsyncSettings):
    """The manager ``m``'s fully-async rollout ``rollout_id``: ``--rollout-batch-size`` groups from
    the buffer, the worker started on the first call (a fresh manager's engines hold the trainer's
    weights: version ``rollout_id``). A given ``handle`` (the weights after rollout
    ``rollout_id - 1``) is loaded first, at the worker's next token boundary; groups staler than
    ``--max-weight-staleness`` are dropped on the way. Scored at put time: assembled, not rescored."""
    import torch

    if m._producer is None:
        m._producer = AsyncProducer(m, settings, rollout_id, m._requeued)
    with m._producer.gate.exclusive():
        if m.engine is None and handle is not None and m.generate_hook is None:
            load = _load_paused(m, handle, rollout_id)  # each engine actor pauses its own generation
        else:
            load = m._finish_load(handle, m._start_load(handle))
        if handle is not None:
            m._producer.gate.version = rollout_id
    took = take_groups(m._producer, m.config.rollout_batch_size, rollout_id)
    groups = took["groups"]
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    hook = m.generate_hook
    who = hook.describe() if hook is not None else f"the {m.config.engine.engine} engine"
    wait = took["metrics"]["async/trainer_wait_s"]
    data = m._assemble(samples, len(groups), wait, custom=hook is not None, who=who, rewards=rewards)[0]
    data.stats.update(took["metrics"])
    data = m._shaped(data, None, None)
    data.weight_load = load
    return data


def evaluate_paused(m, rollout_id: int, handle) -> Dict[str, Any]:
    """The eval after rollout ``rollout_id`` while the worker waits at a token boundary (nothing is
    aborted); engine actors load ``handle`` paused and run the eval after their submission in flight."""
    with m._producer.gate.exclusive():
        if m.engine is None and handle is not None:
            load = _load_paused(m, handle, rollout_id + 1)
            out = m._evaluate(rollout_id, None)
            out["weight_load"] = load
        else:
            out = m._evaluate(rollout_id, handle)
        if handle is not None:
            m._producer.gate.version = rollout_id + 1
    return out


def _load_paused(m, handle, version: int) -> Dict[str, Any]:
    """The engine actors load ``handle`` at their generations' next token boundary (their
    ``weights`` thread), as ``RolloutManager._finish_load`` answers a load."""
    import ray

    def own(rank: int):  # the handle as engine rank - 1 reads it (``engine_weights._for_receiver``)
        return replace(handle, group_rank=rank) if handle.group is not None else handle

    refs = [
        e.update_weights_paused.options(concurrency_group="weights").remote(own(i + 1), version)
        for i, e in enumerate(m.engines)
    ]
    stats = ray.get(refs)
    out: Dict[str, Any] = {"bytes": stats[0]["bytes"], "seconds": max(s["seconds"] for s in stats)}
    if handle.fingerprint is not None:
        out["fingerprints"] = [s["fingerprint"] for s in stats]
    return out


def take_groups(producer: AsyncProducer, count: int, version: int) -> Dict[str, Any]:
    """``count`` groups fresh enough for weight version ``version`` (waiting as needed) and the
    ``async/*`` metrics of the take; raises the worker's error when it stopped."""
    from rl_plugin.rollout.fully_async.buffer import BufferClosed

    t0, groups = time.perf_counter(), []
    inflight = producer.inflight()
    try:
        while len(groups) < count:
            group = producer.buffer.get(version)
            groups.append(group)
    except BufferClosed:
        raise producer.error if producer.error is not None else RuntimeError("the fully-async worker stopped") from None
    staleness = [g.staleness(version) for g in groups]
    samples = [s for g in groups for s in g.samples]
    metrics = {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        "async/partial_frac": sum(g.partial for g in groups) / max(len(samples), 1),
        "async/trainer_wait_s": time.perf_counter() - t0,
        "async/inflight": float(inflight),
        **producer.buffer.metrics(),
    }
    return {"groups": groups, "metrics": metrics}
