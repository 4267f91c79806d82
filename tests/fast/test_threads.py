"""Torch threads per process (``rl_plugin.threads``): a node's cores over the processes of the run
computing on it at once, by schedule and placement; one thread for small models and on GPUs; the
environment's counts win."""

from __future__ import annotations

import json
import os

import pytest

from rl_plugin.threads import (
    ENGINE_THREADS_ENV,
    ROLLOUT_THREADS_ENV,
    TRAIN_THREADS_ENV,
    ThreadPlan,
    ThreadShare,
    is_small_model,
    model_params,
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


SMOLLM2 = dict(  # SmolLM2-135M-Instruct's config.json (the fields the count reads)
    hidden_size=576,
    num_hidden_layers=30,
    vocab_size=49152,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    "config, expected, small",
    [
        (SMOLLM2, 134_515_008, False),  # sum(p.numel()) of the HF model: norms are the 0.03% not counted
        (dict(SMOLLM2, tie_word_embeddings=False), 134_515_008 + 49152 * 576, False),
        (
            dict(hidden_size=16, num_hidden_layers=2, vocab_size=16, num_attention_heads=2, intermediate_size=32),
            0,
            True,
        ),
    ],
)
def test_model_params_from_config(tmp_path, config, expected, small):
    (tmp_path / "config.json").write_text(json.dumps(config))
    n = model_params(str(tmp_path))
    if expected:
        assert abs(n - expected) / expected < 1e-3
    assert is_small_model(str(tmp_path)) is small


def test_an_unreadable_config_is_not_small(tmp_path):
    assert model_params(str(tmp_path)) is None and not is_small_model(str(tmp_path)) and not is_small_model(None)
