"""Torch intra-op threads of the run's processes: a node's cores shared by the processes of the
run that compute on it at the same time.

    threads = max(1, cores // busy)

- ``cores``: the CPUs the process may run on (``os.sched_getaffinity(0)``), read in the process
  itself, so on its own node;
- ``busy``: the run's processes on that node that compute while this one does, itself included
  (``ThreadPlan.for_placement``). With the phases in sequence (the synchronous loop, SFT, a
  colocated run) a train rank shares the node with the other train ranks on it, and a generating
  process (the rollout manager with the ``hf`` engine in it, or an engine actor) with the other
  generating processes on it. Overlapped (``--max-weight-staleness 1``) or fully async
  (``--fully-async``) both phases run at once: every train rank and generating process on the node
  shares it.

One thread in every role when the model is small (under ``SMALL_MODEL_PARAMS`` parameters, counted
from the checkpoint's safetensors headers): an op on it is too short for a second thread's
hand-off to pay. Measured on this project's 2-core CPU machine:
the embedded 0.08 M-parameter model's synchronous loop ran 1.12-1.33x slower per rollout with
2 threads than with 1 (``benchmarks/thread_settings.py``), while SmolLM2-135M trained a 32 x 61
token step 1.8x faster (19.9 -> 11.0 s) and generated 32 x 16 tokens 1.6x faster (6.9 -> 4.3 s).
One thread too on GPU placements (the devices compute; a node's ranks would oversubscribe its
cores). ``RL_PLUGIN_TRAIN_THREADS`` / ``RL_PLUGIN_ROLLOUT_THREADS`` / ``RL_PLUGIN_ENGINE_THREADS``
set a count outright when given.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

TRAIN_THREADS_ENV = "RL_PLUGIN_TRAIN_THREADS"  # each train rank
ROLLOUT_THREADS_ENV = "RL_PLUGIN_ROLLOUT_THREADS"  # the rollout manager (the hf engine when it lives there)
ENGINE_THREADS_ENV = "RL_PLUGIN_ENGINE_THREADS"  # each engine actor
SMALL_MODEL_PARAMS = 10_000_000


@dataclass(frozen=True)
class ThreadShare:
    """One process's share of its node: ``threads()`` is the count it sets (``env`` wins when set)."""

    env: str
    busy: int = 1  # processes of the run computing on the node at once, this one included
    single: bool = True  # one thread whatever the cores (small model, GPU placement, no plan)
    # --deterministic-mode (rl_plugin.configs.true_on_policy): deterministic algorithms, one thread
    deterministic: bool = False

    def threads(self) -> int:
        given = os.environ.get(self.env)
        if given:
            return max(1, int(given))
        if self.single:
            return 1
        return max(1, len(os.sched_getaffinity(0)) // max(1, self.busy))

    def apply(self) -> int:
        """Set torch's intra-op threads to ``threads()`` (and, deterministic, torch's deterministic
        algorithms on); returns the count."""
        import torch

        if self.deterministic:
            torch.use_deterministic_algorithms(True)
        n = self.threads()
        torch.set_num_threads(n)
        return n


@dataclass(frozen=True)
class ThreadPlan:
    train: ThreadShare
    rollout: ThreadShare
    engine: ThreadShare

    @classmethod
    def default(cls) -> "ThreadPlan":
        """No placement known: one thread each, the environment's counts winning."""
        return cls(ThreadShare(TRAIN_THREADS_ENV), ThreadShare(ROLLOUT_THREADS_ENV), ThreadShare(ENGINE_THREADS_ENV))

    @classmethod
    def for_placement(
        cls,
        *,
        train_nodes: Sequence[str],
        rollout_node: Optional[str],
        engine_nodes: Sequence[str],
        concurrent: bool,
        single: bool,
        deterministic: bool = False,
    ) -> "ThreadPlan":
        """The shares of a placement: ``train_nodes`` (each rank's node), ``rollout_node`` (the
        manager's node when it generates: the ``hf`` engine in it; None otherwise, SFT included),
        ``engine_nodes`` (each engine actor's node); ``concurrent``: training and generation at
        once (overlapped, fully async). A role's ``busy`` is the largest count over its nodes (one
        plan for every process of a role). ``deterministic`` (``--deterministic-mode``): one thread
        in every role (the environment's counts still win) and deterministic algorithms."""
        single = single or deterministic
        train = Counter(train_nodes)
        gen = Counter(list(engine_nodes) + ([rollout_node] if rollout_node is not None else []))
        both = train + gen

        def busy(nodes: Iterable[str], own: Counter) -> int:
            per = both if concurrent else own
            return max((per[n] for n in nodes), default=1)

        rollout = [rollout_node] if rollout_node is not None else []
        return cls(
            ThreadShare(TRAIN_THREADS_ENV, busy(train_nodes, train), single, deterministic),
            ThreadShare(ROLLOUT_THREADS_ENV, busy(rollout, gen), single or rollout_node is None, deterministic),
            ThreadShare(ENGINE_THREADS_ENV, busy(engine_nodes, gen), single or not engine_nodes, deterministic),
        )


def is_small_model(parameters: Optional[int]) -> bool:
    """True when a model of ``parameters`` (``checkpoint.disk_space.parameter_count``: the
    safetensors headers) is under ``SMALL_MODEL_PARAMS``; unknown (None) is not small."""
    return parameters is not None and parameters < SMALL_MODEL_PARAMS
