"""Fully async with engine actors (``--fully-async``, two ``hf`` engine actors, real Ray): with
``--rollout-submission-granularity sample`` each actor streams its finished samples
(``EngineActor.generate_stream``) and a group reaches the buffer as soon as its own samples are in,
not when the submission's slowest trajectory ends.

Engine 1 is held mid-generation at a token boundary by a call on its ``weights`` thread (what a
weight load does, ``update_weights_paused``; running it beside the stream is part of what is
tested): engine 0's groups are then in the buffer while engine 1's are still being generated, and
the weights engine 1 loads while held (version 1) draw the rest of its tokens (partial
trajectories). The delivered samples equal, bitwise, those of the whole-submission path
(``group`` granularity: ``generate_pausable``) for the same seeds and prompts. The vLLM engine
actor streams too, and a load mid-stream leaves it partial trajectories."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout.engines.base import SamplingParams
from rl_plugin.rollout.fully_async.producer import AsyncProducer
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.weight_sync import SyncHandle
from tests.support.local_ray import local_ray_cluster

N, GROUPS = 4, 4  # a submission: 4 groups of 4, two groups per engine actor


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache"), num_cpus=3):
        yield


def _engines(cfg, count: int, checkpoint: str):
    from rl_plugin.ray.engine_actor import create_engines
    from rl_plugin.threads import ThreadPlan

    placement = SimpleNamespace(
        num_engines=count, engine_options=lambda i: {"num_cpus": 1}, threads=ThreadPlan.default()
    )
    return create_engines(cfg, placement, checkpoint)


def _flags(d, *extra):
    args = parse_train_flags(
        ["--n-samples-per-prompt", str(N), "--rollout-batch-size", str(GROUPS), "--output-dir", str(d / "out")]
        + ["--fully-async", "--max-weight-staleness", "1", "--rollout-max-response-len", "24"]
        + list(extra)
    )
    prepare_embedded(args)
    return args


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    import ray

    args = _flags(tmp_path_factory.mktemp("run"), "--rollout-num-gpus", "2")
    cfg = RolloutConfig.from_args(args)
    engines = _engines(cfg.engine, 2, args.hf_checkpoint)
    yield SimpleNamespace(args=args, cfg=cfg, engines=engines, settings=LoopConfig.from_args(args).async_settings)
    for e in engines:
        ray.kill(e)


def _manager(setup) -> RolloutManager:
    a = setup.args
    return RolloutManager(setup.cfg, a.hf_checkpoint, a.prompt_data, None, engines=setup.engines, args=a)


def _arm(actor) -> None:
    actor._held, actor._release, actor._load = threading.Event(), threading.Event(), None


def _hold_mid_generation(actor) -> None:
    """On the engine's ``weights`` thread: wait until its generation runs, take the gate at the next
    token boundary (as ``update_weights_paused`` does) and keep it until released, then load the
    handle given with the release (the real paused load, nested in the held gate)."""
    deadline = time.monotonic() + 60
    while not actor.gate._inside and time.monotonic() < deadline:
        time.sleep(1e-4)
    with actor.gate.exclusive():
        actor._held.set()
        actor._release.wait(60)
        if actor._load is not None:
            actor.update_weights_paused(*actor._load)


def _release(actor, load) -> None:
    actor._load = load
    actor._release.set()


def _control(actor, fn, *args):
    import ray

    return ray.get(actor.__ray_call__.options(concurrency_group="control").remote(fn, *args))


def _held_stream(actor, call, version: int):
    """``actor.generate_stream(*call)`` held mid-generation by ``_hold_mid_generation`` on its
    ``weights`` thread; once held (at most the first chunks are out), version ``version`` is loaded
    there. The chunks received before the load, and all of them."""
    import ray

    _control(actor, _arm)
    hold = actor.__ray_call__.options(concurrency_group="weights").remote(_hold_mid_generation)
    stream = actor.generate_stream.remote(*call)
    deadline = time.monotonic() + 60
    while not _control(actor, lambda a: a._held.is_set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    handle = _perturbed_handle(actor, version)
    before = []
    while True:  # the chunks out so far (a held generation yields nothing more)
        ready, _ = ray.wait([stream], timeout=0.2)
        if not ready:
            break
        before.append(ray.get(next(stream)))
    _control(actor, _release, (handle, version))
    ray.get(hold)
    return before, before + [ray.get(ref) for ref in stream]


def _perturbed_handle(engine_actor, version: int) -> SyncHandle:
    """The engine's weights, perturbed, as an object-store sync (what train rank 0 publishes)."""
    import ray

    weights = _control(engine_actor, lambda a: a.engine.weights())
    g = torch.Generator().manual_seed(version)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    return SyncHandle(version=version, node_id="elsewhere", buffer_bytes=0, object_refs=[ray.put(new)])


def _take(producer, count: int, version: int):
    groups = [producer.buffer.get(version, timeout=120) for _ in range(count)]
    assert all(g is not None for g in groups), "the worker delivered too few groups"
    return groups


def _fields(group):
    return [
        (s.index, s.group_index, s.prompt, s.tokens, s.response, s.rollout_log_probs, s.weight_versions, s.status)
        for s in group.samples
    ] + [group.rewards]


def test_engine_actor_groups_arrive_early_and_equal_the_whole_submission_path(setup):
    import ray

    slow = setup.engines[1]
    m = _manager(setup)
    _control(slow, _arm)
    hold = slow.__ray_call__.options(concurrency_group="weights").remote(_hold_mid_generation)
    producer = _producer(m, setup.settings, 0)
    try:
        first = _take(producer, 2, 0)  # engine 0's groups, while engine 1 is held mid-generation
        deadline = time.monotonic() + 10
        while producer.samples_in_flight() > 2 * N and time.monotonic() < deadline:  # the last take's group landing
            time.sleep(0.01)
        recs = list(producer.generating)  # engine 1's records: not delivered yet
        assert _control(slow, lambda a: a._held.is_set())
        assert producer.buffer.records() == [] and len(recs) == 2
        assert {g.record.index for g in first}.isdisjoint(r.index for r in recs)
        assert all(v == 0 for g in first for s in g.samples for v in s.weight_versions)
        handle = _perturbed_handle(slow, 1)
        _control(slow, _release, (handle, 1))
        ray.get(hold)
        rest = _take(producer, 2, 1)
    finally:
        producer.stop()
    assert sorted(g.record.index for g in rest) == sorted(r.index for r in recs)
    spanning = 0
    for g in rest:
        for s in g.samples:
            v = s.weight_versions
            assert len(v) == s.response_length == len(s.rollout_log_probs) and v == sorted(v) and set(v) <= {0, 1}
            spanning += len(set(v)) == 2
        assert g.oldest_version == 0 and g.partial == sum(len(set(s.weight_versions)) == 2 for s in g.samples)
    assert spanning, [s.weight_versions for g in rest for s in g.samples]

    # the same prompts and seed through the whole-submission path (``group`` granularity), no loads:
    # the streamed groups equal its groups bitwise
    prompts = [g.record for g in first] + [g.record for g in rest]
    streamed = _producer(m, setup.settings, 1, requeued=prompts)
    try:
        early = {g.record.index: _fields(g) for g in _take(streamed, GROUPS, 1)}
    finally:
        streamed.stop()
    whole = _producer(m, _group_granularity(setup.settings), 1, requeued=prompts)
    try:
        late = {g.record.index: _fields(g) for g in _take(whole, GROUPS, 1)}
    finally:
        whole.stop()
    assert early.keys() == late.keys() == {r.index for r in prompts}
    for k in early:
        assert early[k] == late[k], k


def _producer(m, settings, version: int, requeued=()) -> AsyncProducer:
    """A worker on the manager's generation parts and fleet, ``requeued`` its first prompts."""
    for rec in requeued:
        m.generation.prompts.requeue(rec)
    return AsyncProducer(m.generation, m.fleet, m.generation.prompts, settings, version)


def _group_granularity(settings):
    from dataclasses import replace

    return replace(settings, rollout_submission_granularity="group")


def test_an_engine_actor_streams_samples_as_they_finish_then_the_rest(setup):
    """One actor's stream: finished samples at token boundaries while others still run, then the
    rest; together bitwise the generations of ``generate_pausable`` (same prompts, seed, version)."""
    import ray

    m = _manager(setup)
    recs = m.generation.prompts.next_batch(2)
    prompts = [m.generation.tokenizer.prompt_ids(r.prompt) for r in recs for _ in range(N)]
    actor, call = setup.engines[0], (prompts, m.generation.params, 7, 0, "retract", 0)
    chunks = [ray.get(ref) for ref in actor.generate_stream.remote(*call)]
    whole = ray.get(actor.generate_pausable.remote(*call))
    idx = [i for i, _ in chunks]
    assert sorted(i for part in idx for i in part) == list(range(len(prompts)))
    assert len([part for part in idx[:-1] if part]) >= 1, idx  # some reported before the call ended
    got = {i: g for part, gens in chunks for i, g in zip(part, gens)}
    assert [got[i] for i in range(len(prompts))] == whole
    early = {i for part in idx[:-1] for i in part}
    assert max(len(got[i].response_ids) for i in early) < max(len(g.response_ids) for g in whole)


def test_the_vllm_engine_actor_streams_and_loads_mid_stream(cluster, tmp_path):
    """The vLLM engine actor: its stepped generation (``vllm_pause``) runs on the stream's thread,
    reports finished requests at boundaries, and a load on the ``weights`` thread mid-stream
    continues the unfinished ones under version 1 (partial trajectories)."""
    import ray

    args = _flags(tmp_path, "--rollout-engine", "vllm", "--rollout-max-context-len", "64")
    cfg = RolloutConfig.from_args(args)
    (actor,) = _engines(cfg.engine, 1, args.hf_checkpoint)
    try:
        prompts = [[1, 5, 9, 4]] * 4 + [[1, 7, 3]] * 4
        params = SamplingParams(0.8, 1.0, 16, stop_token_ids=(2, 7, 12))  # varied lengths
        before, chunks = _held_stream(actor, (prompts, params, 9, 0, "retract", 0), 1)
    finally:
        ray.kill(actor)
    idx = [i for part, _ in chunks for i in part]
    assert sorted(idx) == list(range(len(prompts)))
    assert all(v == 0 for _, gens in before for g in gens for v in g.weight_versions)
    gens = [g for _, part in chunks for g in part]
    assert len([part for part, _ in chunks[:-1] if part]) >= 1  # some reported before the call ended
    for g in gens:
        assert len(g.weight_versions) == len(g.response_ids) == len(g.log_probs)
        assert g.weight_versions == sorted(g.weight_versions) and set(g.weight_versions) <= {0, 1}
    assert any(len(set(g.weight_versions)) == 2 for g in gens), [g.weight_versions for g in gens]
