"""Torch threads per process (``rl_plugin.threads``): a node's cores over the processes of the run
computing on it at once, by schedule and placement; one thread for small models and on GPUs; the
environment's counts win."""

from __future__ import annotations

import os

from rl_plugin.checkpoint.disk_space import parameter_count
from rl_plugin.threads import (
    ENGINE_THREADS_ENV,
    ROLLOUT_THREADS_ENV,
    SMALL_MODEL_PARAMS,
    TRAIN_THREADS_ENV,
    ThreadPlan,
    ThreadShare,
    is_small_model,
)


def busy(plan: ThreadPlan):
    return plan.train.busy, plan.rollout.busy, plan.engine.busy


def test_phases_in_sequence_give_each_phase_the_node():
    # one node: a train rank, the hf engine in the manager: each phase alone on the node
    plan = ThreadPlan.for_placement(
        train_nodes=["a"], rollout_node="a", engine_nodes=[], concurrent=False, single=False
    )
    assert busy(plan) == (1, 1, 1) and not plan.train.single and not plan.rollout.single
    assert plan.engine.single  # no engine actor: nothing to size
    # two ranks and two engine actors on one node: each phase's processes split it
    plan = ThreadPlan.for_placement(
        train_nodes=["a", "a"], rollout_node=None, engine_nodes=["a", "a"], concurrent=False, single=False
    )
    assert busy(plan) == (2, 1, 2) and plan.rollout.single and not plan.engine.single


def test_overlapped_or_fully_async_split_the_node_between_both_phases():
    plan = ThreadPlan.for_placement(train_nodes=["a"], rollout_node="a", engine_nodes=[], concurrent=True, single=False)
    assert busy(plan) == (2, 2, 1)
    plan = ThreadPlan.for_placement(
        train_nodes=["a", "a", "b", "b"], rollout_node=None, engine_nodes=["c", "a"], concurrent=True, single=False
    )
    # node a: 2 ranks + 1 engine; b: 2 ranks; c: 1 engine. A role takes its busiest node.
    assert busy(plan) == (3, 1, 3)
    plan = ThreadPlan.for_placement(
        train_nodes=["a", "a", "b", "b"], rollout_node=None, engine_nodes=["c", "a"], concurrent=False, single=False
    )
    assert busy(plan) == (2, 1, 1)


def test_threads_are_the_cores_over_busy_and_the_environment_wins(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    for env in (TRAIN_THREADS_ENV, ROLLOUT_THREADS_ENV, ENGINE_THREADS_ENV):
        monkeypatch.delenv(env, raising=False)
    assert ThreadShare(TRAIN_THREADS_ENV, busy=1, single=False).threads() == cores
    assert ThreadShare(TRAIN_THREADS_ENV, busy=cores + 1, single=False).threads() == 1
    assert ThreadShare(TRAIN_THREADS_ENV, busy=1, single=True).threads() == 1
    assert ThreadShare(ROLLOUT_THREADS_ENV).threads() == 1  # no plan: one thread, as before
    monkeypatch.setenv(ROLLOUT_THREADS_ENV, "3")
    assert ThreadShare(ROLLOUT_THREADS_ENV, busy=1, single=True).threads() == 3


def test_small_models_are_counted_from_the_checkpoint(tiny_qwen2, tmp_path):
    """The tiny test checkpoint (safetensors headers, as ``parameter_count`` reads them) is small;
    SmolLM2-135M's 134,515,008 is not; a directory without safetensors is unknown, not small."""
    n = parameter_count(tiny_qwen2)
    assert n is not None and 0 < n < SMALL_MODEL_PARAMS and is_small_model(n)
    assert not is_small_model(134_515_008) and not is_small_model(SMALL_MODEL_PARAMS)
    assert parameter_count(str(tmp_path)) is None and not is_small_model(None)


def test_deterministic_mode_fixes_one_thread_per_role_and_turns_on_deterministic_algorithms(monkeypatch):
    import torch

    for env in (TRAIN_THREADS_ENV, ROLLOUT_THREADS_ENV, ENGINE_THREADS_ENV):
        monkeypatch.delenv(env, raising=False)
    plan = ThreadPlan.for_placement(
        train_nodes=["a"], rollout_node=None, engine_nodes=["a"], concurrent=False, single=False, deterministic=True
    )
    shares = (plan.train, plan.rollout, plan.engine)
    assert all(s.single and s.deterministic for s in shares)
    assert [s.threads() for s in shares] == [1, 1, 1]  # whatever the node's cores
    monkeypatch.setenv(TRAIN_THREADS_ENV, "2")  # the environment still names another fixed count
    assert plan.train.threads() == 2
    was, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    try:
        torch.use_deterministic_algorithms(False)
        assert plan.engine.apply() == 1 and torch.are_deterministic_algorithms_enabled()
        ThreadShare(ENGINE_THREADS_ENV).apply()  # the default share leaves the setting as it is
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
        torch.set_num_threads(threads)
    default = ThreadPlan.for_placement(
        train_nodes=["a"], rollout_node="a", engine_nodes=[], concurrent=False, single=False
    )
    assert not default.train.deterministic and not default.train.single
