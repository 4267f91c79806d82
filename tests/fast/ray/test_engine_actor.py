"""The engine actor's own code (``rl_plugin.ray.engine_actor.EngineActor``), run in this process
on the real ``hf`` engine and the embedded tiny model (the class is what ``create_engines`` puts
in a Ray actor): a seeded generate, the pausable generate stamping the version it holds, and the
streamed generate giving every sample exactly once, the same samples as the call it wraps.
(The actor in a real run: ``tests/fast/e2e``.)"""

from __future__ import annotations

import os

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs.run import RunConfig
from rl_plugin.loop.embedded_setup import ensure_tiny_model
from rl_plugin.ray.engine_actor import EngineActor
from rl_plugin.rollout.engines.base import SamplingParams

PROMPTS = [[3, 4, 5, 11], [6, 7, 11], [8, 9, 10, 3, 11], [4, 11]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("cache"))
    config = RunConfig.from_args(parse_train_flags(["--train-backend", "fsdp"])).rollout.engine
    assert config.engine == "hf"
    threads = torch.get_num_threads()  # the actor sets its process's (here: this one's) torch threads
    yield EngineActor(config, str(model))
    torch.set_num_threads(threads)


def _samples(gens):
    return [(g.prompt_ids, g.response_ids, g.log_probs) for g in gens]


def test_the_actor_is_this_process_outside_ray(actor):
    assert actor.pid() == os.getpid() and actor.node_id() == "local"


def test_a_seeded_generate_is_reproducible(actor):
    first = actor.generate(PROMPTS, PARAMS, seed=7, first_sample=0)
    assert [g.prompt_ids for g in first] == PROMPTS
    assert all(0 < len(g.response_ids) <= 6 and len(g.log_probs) == len(g.response_ids) for g in first)
    assert _samples(actor.generate(PROMPTS, PARAMS, seed=7, first_sample=0)) == _samples(first)
    assert first[0].weight_versions is None  # no gate: no versions


def test_the_pausable_generate_stamps_the_version_it_holds_at_least(actor):
    gens = actor.generate_pausable(PROMPTS, PARAMS, seed=7, first_sample=0, mode="retract", floor=3)
    assert actor.gate.version == 3 and actor.gate.mode == "retract"
    assert all(g.weight_versions == [3] * len(g.response_ids) for g in gens)
    assert _samples(gens) == _samples(actor.generate(PROMPTS, PARAMS, seed=7, first_sample=0))
    actor.generate_pausable(PROMPTS[:1], PARAMS, seed=7, first_sample=0, mode="in_place", floor=1)
    assert actor.gate.version == 3  # a floor below the version held does not lower it


def test_the_stream_gives_every_sample_once_as_the_call_it_wraps(actor):
    chunks = list(actor.generate_stream(PROMPTS, PARAMS, seed=11, first_sample=4, mode="retract", floor=0))
    indices = [i for idx, _ in chunks for i in idx]
    assert sorted(indices) == list(range(len(PROMPTS))) and len(indices) == len(PROMPTS)
    by_index = {i: g for idx, gens in chunks for i, g in zip(idx, gens)}
    whole = actor.generate_pausable(PROMPTS, PARAMS, seed=11, first_sample=4, mode="retract", floor=0)
    assert _samples(by_index[i] for i in range(len(PROMPTS))) == _samples(whole)
    assert actor.gate.on_generations_done is None  # the stream's hook is removed when it ends
