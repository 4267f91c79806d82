"""The fully-async source (``--fully-async``): each rollout taken from the background worker's buffer.

``rollout(k, handle)``: the worker (``producer.AsyncProducer``) starts on the first call, at the
trainer weight version the fleet holds (the run's start-up or restart sync said which; a fresh
manager that was told nothing: version ``k``); a given ``handle`` (the weights after rollout
``k - 1``: version ``k``) is loaded first, at the worker's next token boundary (``gate.exclusive``;
engine actors each pause their own generation, ``EngineFleet.load_paused``); then
``--rollout-batch-size`` groups come from the buffer, the staler than ``--max-weight-staleness``
dropped on the way (``take_groups``). Scored at put time: assembled, not rescored.

``evaluate(k, handle)``: the eval after rollout k while the worker waits at a token boundary
(nothing is aborted); engine actors load ``handle`` paused and run the eval after their submission
in flight. ``state_dict``: the worker's ``snapshot`` (dataset position and every prompt taken but
not in a rollout, one atomic read).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch

from rl_plugin.configs.async_training import AsyncConfig
from rl_plugin.rollout.fleet import EngineFleet
from rl_plugin.rollout.fully_async.buffer import BufferClosed
from rl_plugin.rollout.fully_async.producer import AsyncProducer
from rl_plugin.rollout.generation.source import GenerationSource
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.weight_sync import SyncHandle


class FullyAsyncSource:
    def __init__(self, gen: GenerationSource, fleet: EngineFleet, settings: AsyncConfig):
        self.gen, self.fleet, self.settings = gen, fleet, settings
        self.producer: Optional[AsyncProducer] = None  # started by the first rollout

    def rollout(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> RolloutData:
        gen, fleet = self.gen, self.fleet
        if self.producer is None:
            held = fleet.version if fleet.version is not None else rollout_id
            self.producer = AsyncProducer(gen, fleet, gen.prompts, self.settings, held)
        p = self.producer
        with p.gate.exclusive():
            if fleet.engine is None and handle is not None and gen.generate_hook is None:
                load = fleet.load_paused(handle, rollout_id)  # each engine actor pauses its own generation
            else:
                load = fleet.finish_load(handle, fleet.start_load(handle), rollout_id)
            if handle is not None:
                p.gate.version = rollout_id
        took = take_groups(p, gen.config.rollout_batch_size, rollout_id)
        groups = took["groups"]
        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        wait = took["metrics"]["async/trainer_wait_s"]
        custom = gen.generate_hook is not None
        data = gen.assemble(samples, len(groups), wait, custom=custom, who=gen.describe(), rewards=rewards)[0]
        data.stats.update(took["metrics"])
        data = gen.shaped(data)
        data.dataset_state = self.state_dict()
        data.weight_load = load
        fleet.sleep()
        return data

    def evaluate(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> Dict[str, Any]:
        p, fleet = self.producer, self.fleet
        if p is None:
            return self.gen.evaluate(rollout_id, handle)
        with p.gate.exclusive():
            if fleet.engine is None and handle is not None:
                load = fleet.load_paused(handle, rollout_id + 1)
                out = self.gen.evaluate(rollout_id, None)
                out["weight_load"] = load
            else:
                out = self.gen.evaluate(rollout_id, handle)
            if handle is not None:
                p.gate.version = rollout_id + 1
        return out

    def state_dict(self) -> Dict[str, Any]:
        if self.producer is None:
            return self.gen.state_dict()
        return self.producer.snapshot()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The checkpoint's position; its ``async_requeue`` prompts are the worker's first."""
        self.gen.load_state_dict(state)

    def stop(self) -> None:
        """End the worker (after its submission in flight)."""
        if self.producer is not None:
            self.producer.stop()


def take_groups(producer: AsyncProducer, count: int, version: int) -> Dict[str, Any]:
    """``count`` groups fresh enough for weight version ``version`` (waiting as needed) and the
    ``async/*`` metrics of the take; raises the worker's error when it stopped."""
    t0, groups = time.perf_counter(), []
    in_flight = producer.samples_in_flight()
    try:
        while len(groups) < count:
            group = producer.buffer.get(version)
            groups.append(group)
    except BufferClosed:
        raise producer.error if producer.error is not None else RuntimeError("the fully-async worker stopped") from None
    staleness = [g.staleness(version) for g in groups]
    samples: List[Any] = [s for g in groups for s in g.samples]
    metrics = {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        "async/partial_frac": sum(g.partial for g in groups) / max(len(samples), 1),
        "async/trainer_wait_s": time.perf_counter() - t0,
        "async/inflight": float(in_flight),
        **producer.buffer.metrics(),
    }
    return {"groups": groups, "metrics": metrics}
