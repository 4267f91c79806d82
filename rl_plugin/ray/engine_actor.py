"""Rollout engines in their own Ray actor processes (``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine``).

One ``EngineActor`` per engine: ``--rollout-num-gpus / --rollout-num-gpus-per-engine`` of them,
each on its own placement bundle (``--rollout-num-gpus-per-engine`` GPUs; on a CPU machine one
CPU, so an "engine GPU" is an engine process). vLLM always runs in one: its CPU worker makes
``torch.set_num_threads`` a no-op process-wide and reseeds the global RNG, which must not leak
into the rollout manager. The manager (``rl_plugin.rollout.manager``) spreads a rollout's samples
over the engines and gathers them in group order.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import ray

from rl_plugin.configs import EngineConfig
from rl_plugin.ray.gpu_check import require_cuda
from rl_plugin.rollout import abort
from rl_plugin.rollout.engines.base import Generation, SamplingParams, make_engine
from rl_plugin.rollout.engines.pause import GenerationGate
from rl_plugin.threads import ENGINE_THREADS_ENV, ThreadShare
from rl_plugin.weight_sync import SyncHandle, WeightReceiver, load_sync, node_id
from rl_plugin.weight_sync.distributed import abort_waits

# One thread beside the actor's own, for ``abort`` while a call runs (a threaded actor whose
# default group stays one thread: the calls run in order, on one thread, as before).
CONTROL_GROUP = {"control": 1}
# fully async: a weight load that pauses the generation in flight at a token boundary
WEIGHTS_GROUP = {"weights": 1}


class EngineActor:
    def __init__(self, config: EngineConfig, checkpoint_dir: str, threads: Optional[ThreadShare] = None):
        import torch

        # before the engine: vLLM's CPU worker makes torch.set_num_threads a no-op in its process
        (threads or ThreadShare(ENGINE_THREADS_ENV)).apply()
        require_cuda(f"rollout engine {config.engine}")  # a GPU bundle without CUDA: fail here, not generate on the CPU
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.engine = make_engine(config, checkpoint_dir, device=device)
        self.receiver = WeightReceiver()
        self.gate = GenerationGate()  # fully async: the token-boundary pause of generate_pausable

    def pid(self) -> int:
        return os.getpid()

    def generate(
        self, prompts: Sequence[List[int]], params: SamplingParams, seed: int, first_sample: int
    ) -> List[Generation]:
        return self.engine.generate(prompts, params, seed=seed, first_sample=first_sample)

    def generate_pausable(
        self, prompts: Sequence[List[int]], params: SamplingParams, seed: int, first_sample: int, mode: str, floor: int
    ) -> List[Generation]:
        """Fully async: ``generate`` paused at token boundaries by ``update_weights_paused``
        (partial rollouts, ``rl_plugin.rollout.engines.pause``); ``floor``: the version the
        engine holds at least, the worker's at its submission's start (after a load of its own,
        ``update_weights``, e.g. the run's start-up sync: the fleet's version, never the next one)."""
        gate = self.gate
        gate.mode, gate.version = mode, max(gate.version, int(floor))
        return self.engine.generate(prompts, params, seed=seed, first_sample=first_sample, gate=gate)

    def generate_stream(
        self, prompts: Sequence[List[int]], params: SamplingParams, seed: int, first_sample: int, mode: str, floor: int
    ) -> Iterator[Tuple[List[int], List[Generation]]]:
        """Fully async with ``--rollout-submission-granularity sample``: ``generate_pausable`` as a
        Ray streaming generator. Yields (indices in this call, their finished ``Generation``s) as
        the engine reports them at token boundaries (``GenerationGate.on_generations_done``), then
        the rest when the call ends: every index exactly once, each ``Generation`` the object the
        call returns (same tokens, log-probs and versions as ``generate_pausable``'s). The engine
        runs on a thread of its own so that this method can yield meanwhile; a load on the
        ``weights`` thread still pauses it at a token boundary, an ``abort`` still ends it."""
        chunks: "queue.Queue[Any]" = queue.Queue()
        result: Dict[str, Any] = {}

        def run() -> None:
            try:
                result["gens"] = self.generate_pausable(prompts, params, seed, first_sample, mode, floor)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the stream
                result["error"] = exc
            finally:
                chunks.put(None)

        self.gate.on_generations_done = lambda idx, gens: chunks.put((list(idx), list(gens)))
        thread = threading.Thread(target=run, name="rl_plugin-engine-stream", daemon=True)
        thread.start()
        sent = set()
        try:
            while (chunk := chunks.get()) is not None:
                sent.update(chunk[0])
                yield chunk
            thread.join()
        finally:
            self.gate.on_generations_done = None
        if "error" in result:
            raise result["error"]
        rest = [i for i in range(len(result["gens"])) if i not in sent]
        yield rest, [result["gens"][i] for i in rest]

    def update_weights_paused(self, handle: SyncHandle, version: int) -> Dict[str, Any]:
        """Fully async, on the ``weights`` thread: the load at the next token boundary of the
        generation in flight (or at once when idle); the tokens after it carry ``version``."""
        gate = self.gate
        with gate.exclusive():
            stats = load_sync(self.engine, self.receiver, handle)
            gate.version = int(version)
        return stats

    def abort(self) -> None:
        """Abort the generation in progress (the ``hf`` engine between two decode steps); runs on
        the actor's ``control`` thread (``rl_plugin.rollout.abort``). vLLM and SGLang finish the
        call in progress: the actor is killed at the teardown. A distributed weight load waiting
        for the train call ends too."""
        abort_waits()
        abort.request()

    def sleep(self) -> None:
        """Colocated: free the engine's device memory between two calls (``RolloutEngine.sleep``)."""
        self.engine.sleep()

    def wake_up(self, tags=None) -> None:
        self.engine.wake_up(tags)

    def node_id(self) -> str:
        return node_id()

    def update_weights(self, handle: SyncHandle) -> Dict[str, Any]:
        """Load the sync behind ``handle`` in place, bucket after bucket (from train rank 0's
        shared-memory segment on this node, else the object store); returns bytes loaded,
        seconds spent and, under --check-weight-sync, this engine's fingerprint."""
        return load_sync(self.engine, self.receiver, handle)


def create_engines(config: EngineConfig, placement, checkpoint_dir: str) -> List["ray.actor.ActorHandle"]:
    """Start the engine actors and wait until every one is up (so start-up errors surface here)."""
    remote = ray.remote(concurrency_groups={**CONTROL_GROUP, **WEIGHTS_GROUP})(EngineActor)
    actors = [
        remote.options(**placement.engine_options(i), max_restarts=0).remote(
            config, checkpoint_dir, placement.threads.engine
        )
        for i in range(placement.num_engines)
    ]
    ray.get([a.pid.remote() for a in actors])
    return actors
