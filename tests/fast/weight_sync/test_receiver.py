"""An engine's side of a sync (``rl_plugin.weight_sync.receiver``): the reader that serves a handle,
the version recorded once the last bucket was taken, the refusal when no transport reaches this
engine, and ``load_sync``'s bytes and fingerprint. The engine is a dict of tensors with the two
methods ``load_sync`` calls (a real HF engine: ``test_weight_sync.py``)."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.weight_sync.fingerprint import weights_fingerprint
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.receiver import WeightReceiver, load_sync
from rl_plugin.weight_sync.shared_memory import SharedMemoryWriter


class DictEngine:
    def __init__(self, sd):
        self.sd = {n: t.clone() for n, t in sd.items()}
        self.loads = []

    def update_weights(self, bucket):
        self.loads.append(list(bucket))
        for name, t in bucket.items():
            self.sd[name].copy_(t)

    def weights(self):
        return self.sd


@pytest.fixture
def writer():
    w = SharedMemoryWriter(strict=True)
    yield w
    w.close()


def _publish(writer, sd, version, buffer_bytes=1 << 20, fingerprint=False):
    handle = SyncHandle(version=version, node_id="local", buffer_bytes=buffer_bytes)
    writer.write(sd, handle, SyncRequest(buffer_bytes=buffer_bytes))
    if fingerprint:
        handle.fingerprint = weights_fingerprint(sd)
    return handle


def test_load_sync_takes_the_engine_to_the_trainers_weights_bitwise(writer):
    start = {"a": torch.zeros(8), "b": torch.zeros(2, 4)}
    trained = {"a": torch.arange(8.0), "b": torch.randn(2, 4, generator=torch.Generator().manual_seed(0))}
    engine, receiver = DictEngine(start), WeightReceiver()
    assert receiver.version == 0 and receiver.node == "local"
    out = load_sync(engine, receiver, _publish(writer, trained, 1, buffer_bytes=32, fingerprint=True))
    assert receiver.version == 1 and engine.loads == [["a"], ["b"]]  # 32-byte buckets: one tensor each
    assert out["bytes"] == 64.0 and out["seconds"] >= 0
    assert out["fingerprint"] == weights_fingerprint(trained)
    assert all(torch.equal(engine.sd[n], trained[n]) for n in trained)
    again = {**trained, "b": trained["b"] * 3}
    out = load_sync(engine, receiver, _publish(writer, again, 2))
    assert engine.loads[-1] == ["b"] and out["bytes"] == 32.0 and "fingerprint" not in out
    assert receiver.version == 2 and torch.equal(engine.sd["b"], trained["b"] * 3)


def test_no_transport_reaches_this_engine():
    handle = SyncHandle(version=1, node_id="other-node", buffer_bytes=1, segment="/dev/shm/x")
    receiver = WeightReceiver()
    with pytest.raises(RuntimeError, match=r"this engine \(node local\) cannot read .*/dev/shm/x \(node other-node\)"):
        list(receiver.buckets(handle))
    assert receiver.version == 0
