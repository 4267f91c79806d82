"""The engine fleet (``rl_plugin.rollout.fleet``) with its in-process ``hf`` engine and a real
shared-memory weight sync: ``load`` leaves the engine bitwise equal to the published weights and
answers bytes / seconds / fingerprints; the version is set only by a finished load; colocated, the
engines wake for a load (weights only) or a generation and sleep after, in that order (the
colocation trace, ``rl_plugin.phases``); not colocated, nothing sleeps. The engine actors' path
(Ray) runs in ``ray/`` and the e2e loops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_plugin.models.tiny import make_tiny_hf_checkpoint
from rl_plugin.phases import TRACE_ENV
from rl_plugin.rollout.engines.hf_engine import HFEngine
from rl_plugin.rollout.fleet import EngineFleet, answer, for_receiver
from rl_plugin.weight_sync import SyncHandle, SyncRequest, WeightPublisher, node_id, weights_fingerprint
from rl_plugin.weight_sync.handle import GroupSpec


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    ck = make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("fleet") / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64
    )
    return HFEngine(str(ck))


@pytest.fixture
def trace(tmp_path, monkeypatch):
    path = tmp_path / "trace.txt"
    monkeypatch.setenv(TRACE_ENV, str(path))
    return lambda: path.read_text().splitlines() if path.exists() else []


def _perturbed(sd, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def test_for_receiver_sets_the_group_rank_only_for_the_distributed_transport():
    plain = SyncHandle(version=3, node_id="n", buffer_bytes=1)
    assert for_receiver(plain, 2) is plain
    grouped = dataclasses.replace(plain, group=GroupSpec(host="127.0.0.1", port=29500, world=3, epoch=0))
    assert for_receiver(grouped, 2).group_rank == 2 and grouped.group_rank == 0


def test_answer_takes_one_engines_bytes_and_the_slowest_seconds():
    stats = [
        {"bytes": 10.0, "seconds": 0.5, "version": 1, "fingerprint": "a"},
        {"bytes": 10.0, "seconds": 1.5, "version": 1, "fingerprint": "b"},
    ]
    plain = SyncHandle(version=1, node_id="n", buffer_bytes=1)
    assert answer(plain, stats) == {"bytes": 10.0, "seconds": 1.5}
    checked = dataclasses.replace(plain, fingerprint={"x": "y"})
    assert answer(checked, stats) == {"bytes": 10.0, "seconds": 1.5, "versions": [1, 1], "fingerprints": ["a", "b"]}


def test_a_colocated_load_wakes_the_weights_loads_and_sleeps(engine, trace):
    fleet = EngineFleet(engine, [], colocated=True)
    assert fleet.node_ids() == [node_id()] and fleet.version is None
    new = _perturbed(engine.weights(), 1)
    pub = WeightPublisher("shared_memory")
    try:
        handle = pub.publish(new, SyncRequest(buffer_bytes=8192, transport="shared_memory", fingerprint=True))
        out = fleet.load(handle, version=4)
    finally:
        pub.close()
    total = sum(v.numel() * v.element_size() for v in new.values())
    assert out["bytes"] == total and out["seconds"] >= 0
    assert out["fingerprints"] == [weights_fingerprint(new)] == [weights_fingerprint(engine.weights())]
    assert out["versions"] == [handle.version]  # the sync version the engine holds now
    assert fleet.version == 4
    assert trace() == ["engine.wake_up weights", f"engine.load {handle.version}", "engine.sleep"]


def test_a_generation_wakes_everything_and_no_handle_loads_nothing(engine, trace):
    fleet = EngineFleet(engine, [], colocated=True)
    fleet.version = 2
    loading = fleet.start_load(None, generating=True)
    assert loading is None and fleet.finish_load(None, loading, 3) is None
    assert fleet.version == 2  # no load: the version the engines hold is unchanged
    fleet.sleep()
    assert trace() == ["engine.wake_up", "engine.sleep"]


def test_not_colocated_nothing_sleeps_or_wakes(engine, trace):
    fleet = EngineFleet(engine, [], colocated=False)
    new = _perturbed(engine.weights(), 2)
    pub = WeightPublisher("shared_memory")
    try:
        handle = pub.publish(new, SyncRequest(buffer_bytes=1 << 20, transport="shared_memory"))
        out = fleet.load(handle, version=1)
    finally:
        pub.close()
    assert "fingerprints" not in out
    assert weights_fingerprint(engine.weights()) == weights_fingerprint(new)
    assert trace() == [f"engine.load {handle.version}"]
    fleet.abort()  # no engine actors: nothing to abort
