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


def test_only_host_transports_want_host_tensors():
    assert WeightPublisher("distributed").host_tensors is False
    for transport in ("auto", "shared_memory", "object_store"):
        assert WeightPublisher(transport).host_tensors is True


class _StreamingBackend:
    """A backend's export as the train actor sees it; records the ``host`` it is asked for."""

    tied_names = ()
    lora_enabled = False  # full weights travel (with LoRA: the adapters, ``stream_lora_adapters``)

    def __init__(self):
        self.hosts = []

    def hf_weight_specs(self):
        return {"a.weight": torch.empty(4, device="meta")}

    def stream_hf_weights(self, *, host=True):
        self.hosts.append(host)
        yield "a.weight", torch.zeros(4, device="meta")


def test_train_actor_streams_the_export_from_the_device_for_the_distributed_transport(monkeypatch):
    """The backend's stream was copied to the CPU before the publisher saw it (``.to("cpu")`` in
    every backend's export): under the distributed transport rank 0 now asks it for device tensors."""
    from rl_plugin.ray.train_actor import TrainActor

    threads = torch.get_num_threads()
    try:
        actor = TrainActor(0, 1)
    finally:
        torch.set_num_threads(threads)
    actor.backend = _StreamingBackend()
    actor.publisher = WeightPublisher("distributed")
    recorder = _Recorder()
    monkeypatch.setattr(actor.publisher.dist, "open", lambda specs, handle, request: recorder)
    spec = GroupSpec(host="127.0.0.1", port=1, world=2, epoch=0)
    actor.export_weight_buckets(SyncRequest(buffer_bytes=1 << 20, transport="distributed", group=spec))
    assert actor.backend.hosts == [False] and recorder.devices == [("a.weight", "meta")]


def _fsdp_stream_worker(rank, world):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from tests.support.megatron_common import make_args

    backend = FSDPBackend.from_args(make_args("--train-backend", "fsdp"))
    on_host = [(n, t.clone()) for n, t in backend.stream_hf_weights()]
    kept = [(n, t.clone()) for n, t in backend.stream_hf_weights(host=False)]
    return [n for n, _ in on_host] == [n for n, _ in kept] and all(
        torch.equal(a, b) for (_, a), (_, b) in zip(on_host, kept)
    )


def test_fsdp_stream_with_or_without_the_host_copy_is_the_same_export():
    from tests.support.harness import run_world

    assert run_world(_fsdp_stream_worker, 1) == [True]
