"""The transport interface's shared parts (``rl_plugin.weight_sync.transport``): the meta specs of an
export, a non-streaming writer's collected stream, and ``write_all``'s abort on a failing export."""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.transport import TransportWriter, WriteStream, specs_of, write_all


class RecordingWriter(TransportWriter):
    """A writer that cannot stream: the default ``open`` collects, then one ``write``."""

    name = "recording"

    def __init__(self):
        self.writes = []

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        self.writes.append((dict(sd), handle.version))
        handle.sent_bytes += sum(t.numel() * t.element_size() for t in sd.values())


def test_specs_are_meta_tensors_of_the_same_names_shapes_and_dtypes():
    sd = {"b": torch.ones(2, 3, dtype=torch.bfloat16), "a": torch.zeros(4)}
    specs = specs_of(sd)
    assert list(specs) == ["b", "a"]
    assert [(t.device.type, tuple(t.shape), t.dtype) for t in specs.values()] == [
        ("meta", (2, 3), torch.bfloat16),
        ("meta", (4,), torch.float32),
    ]


def test_the_default_stream_writes_once_at_close():
    writer, handle = RecordingWriter(), SyncHandle(version=3, node_id="n", buffer_bytes=64)
    stream = writer.open(specs_of({"a": torch.zeros(2)}), handle, SyncRequest(buffer_bytes=64))
    stream.add("a", torch.ones(2))
    stream.add("b", torch.full((3,), 2.0))
    assert writer.writes == []
    stream.close()
    ((sd, version),) = writer.writes
    assert version == 3 and list(sd) == ["a", "b"] and torch.equal(sd["b"], torch.full((3,), 2.0))
    assert handle.sent_bytes == 20


class FailingStream(WriteStream):
    def __init__(self):
        self.added, self.closed, self.aborted = [], False, False

    def add(self, name, tensor):
        if name == "bad":
            raise ValueError("export failed at 'bad'")
        self.added.append(name)

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = True


def test_write_all_aborts_a_failing_export_and_closes_a_whole_one():
    ok = FailingStream()
    write_all(ok, {"x": torch.zeros(1), "y": torch.zeros(1)})
    assert ok.added == ["x", "y"] and ok.closed and not ok.aborted
    bad = FailingStream()
    with pytest.raises(ValueError, match="export failed at 'bad'"):
        write_all(bad, {"x": torch.zeros(1), "bad": torch.zeros(1), "z": torch.zeros(1)})
    assert bad.added == ["x"] and bad.aborted and not bad.closed
    write_all(None, {"x": torch.zeros(1)})  # a writer taking no part in the sync: nothing to feed
