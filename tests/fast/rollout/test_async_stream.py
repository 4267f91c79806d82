"""Fully async with engine actors (``--fully-async``, two ``hf`` engine actors, real Ray): with
``--rollout-submission-granularity sample`` each actor streams its finished samples
(``EngineActor.generate_stream``) and a group reaches the buffer as soon as its own samples are in,
not when the submission's slowest trajectory ends.

Engine 1 is held mid-generation at a token boundary by a call on its ``weights`` thread (what a
weight load does, ``update_weights_paused``; running it beside the stream is part of what is
tested): engine 0's groups are then in the buffer while engine 1's are still being generated, and
the weights engine 1 loads while held (version 1) draw the rest of its tokens (partial
trajectories). The delivered samples equal, bitwise, those of the whole-submission path
(``group`` granularity: ``generate_pausable``) for the same seeds and prompts."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.embedded import prepare_embedded
from rl_plugin.rollout.async_producer import AsyncProducer
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.weight_sync import SyncHandle
from tests.support.local_ray import local_ray_cluster

N, GROUPS = 4, 4  # a submission: 4 groups of 4, two groups per engine actor


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import ray

    from rl_plugin.ray.engine_actor import create_engines

    with local_ray_cluster(tmp_path_factory.mktemp("cache"), num_cpus=3):
        d = tmp_path_factory.mktemp("run")
        args = parse_train_flags(
            ["--n-samples-per-prompt", str(N), "--rollout-batch-size", str(GROUPS), "--output-dir", str(d / "out")]
            + ["--fully-async", "--max-weight-staleness", "1", "--rollout-max-response-len", "24"]
            + ["--rollout-num-gpus", "2"]
        )
        prepare_embedded(args)
        cfg = RolloutConfig.from_args(args)
        placement = SimpleNamespace(num_engines=2, engine_options=lambda i: {"num_cpus": 1})
        engines = create_engines(cfg.engine, placement, args.hf_checkpoint)
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
    producer = AsyncProducer(m, setup.settings, 0)
    try:
        first = _take(producer, 2, 0)  # engine 0's groups, while engine 1 is held mid-generation
        deadline = time.monotonic() + 10
        while producer.inflight() > 2 * N and time.monotonic() < deadline:  # the last take's group landing
            time.sleep(0.01)
        recs = list(producer.in_flight)  # engine 1's records: not delivered yet
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
    streamed = AsyncProducer(m, setup.settings, 1, requeued=prompts)
    try:
        early = {g.record.index: _fields(g) for g in _take(streamed, GROUPS, 1)}
    finally:
        streamed.stop()
    whole = AsyncProducer(m, _group_granularity(setup.settings), 1, requeued=prompts)
    try:
        late = {g.record.index: _fields(g) for g in _take(whole, GROUPS, 1)}
    finally:
        whole.stop()
    assert early.keys() == late.keys() == {r.index for r in prompts}
    for k in early:
        assert early[k] == late[k], k


def _group_granularity(settings):
    from dataclasses import replace

    return replace(settings, granularity="group")


def test_an_engine_actor_streams_samples_as_they_finish_then_the_rest(setup):
    """One actor's stream: finished samples at token boundaries while others still run, then the
    rest; together bitwise the generations of ``generate_pausable`` (same prompts, seed, version)."""
    import ray

    m = _manager(setup)
    recs = m.train.next_batch(2)
    prompts = [m.tokenizer.prompt_ids(r.prompt) for r in recs for _ in range(N)]
    actor, call = setup.engines[0], (prompts, m.params, 7, 0, "retract", 0)
    chunks = [ray.get(ref) for ref in actor.generate_stream.remote(*call)]
    whole = ray.get(actor.generate_pausable.remote(*call))
    idx = [i for i, _ in chunks]
    assert sorted(i for part in idx for i in part) == list(range(len(prompts)))
    assert len([part for part in idx[:-1] if part]) >= 1, idx  # some reported before the call ended
    got = {i: g for part, gens in chunks for i, g in zip(part, gens)}
    assert [got[i] for i in range(len(prompts))] == whole
    early = {i for part in idx[:-1] for i in part}
    assert max(len(got[i].response_ids) for i in early) < max(len(g.response_ids) for g in whole)
