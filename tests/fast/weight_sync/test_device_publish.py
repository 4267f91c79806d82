"""Train rank 0's side of the distributed transport keeps each exported tensor where the export
has it (issue 37 item 8: a GPU -> CPU -> GPU round trip before NCCL's broadcast); shared memory and
the object store still get host tensors. A fake target device ("meta") shows where each tensor is."""

from __future__ import annotations

import torch

from rl_plugin.weight_sync.handle import GroupSpec, SyncRequest
from rl_plugin.weight_sync.publisher import WeightPublisher
from rl_plugin.weight_sync.transport import WriteStream


class _Recorder(WriteStream):
    def __init__(self):
        self.devices = []

    def add(self, name, tensor):
        self.devices.append((name, tensor.device.type))

    def close(self):
        pass


def test_distributed_transport_publishes_device_tensors_in_place(monkeypatch):
    publisher = WeightPublisher("distributed")
    recorder = _Recorder()
    monkeypatch.setattr(publisher.dist, "open", lambda specs, handle, request: recorder)
    sd = {"a.weight": torch.zeros(4, 2, device="meta"), "b.weight": torch.zeros(3, device="meta")}
    spec = GroupSpec(host="127.0.0.1", port=1, world=2, epoch=0)
    publisher.publish(sd, SyncRequest(buffer_bytes=1 << 20, transport="distributed", group=spec))
    assert recorder.devices == [("a.weight", "meta"), ("b.weight", "meta")]


def test_host_transports_still_get_host_tensors(monkeypatch):
    publisher = WeightPublisher("object_store")
    recorder = _Recorder()
    monkeypatch.setattr(publisher.store, "open", lambda specs, handle, request: recorder)
    publisher.publish({"a.weight": torch.zeros(2)}, SyncRequest(buffer_bytes=1 << 20, transport="object_store"))
    assert recorder.devices == [("a.weight", "cpu")]
