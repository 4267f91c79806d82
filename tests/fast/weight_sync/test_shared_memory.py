"""The shared-memory transport (``rl_plugin.weight_sync.shared_memory``) in one process: the
writer's change tracking (``changed_at``, the bytes it copies), the reader's buckets (only what
changed since the version it holds, a fused group whole, bitwise), double buffering's slots, and a
stream that disagrees with its layout. (With a real engine: ``test_weight_sync.py``.)"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.shared_memory import SharedMemoryReader, SharedMemoryWriter
from rl_plugin.weight_sync.transport import specs_of

Q, K, V = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
OPROJ = "model.layers.0.self_attn.o_proj.weight"


def _export(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4, 4, generator=g) for n in ("embed", Q, K, V, OPROJ)}


def _sync(writer, sd, version, slots=1):
    handle = SyncHandle(version=version, node_id="local", buffer_bytes=1 << 20)
    writer.write(sd, handle, SyncRequest(buffer_bytes=1 << 20, slots=slots))
    return handle


def _read(reader, handle, held):
    return {n: t.clone() for b in reader.buckets(handle, held) for n, t in b.items()}


@pytest.fixture
def writer():
    w = SharedMemoryWriter(strict=True)
    yield w
    w.close()


def test_second_sync_copies_and_serves_only_what_changed(writer):
    sd = _export()
    h1 = _sync(writer, sd, 1)
    assert h1.changed_at == dict.fromkeys(sd, 1) and h1.sent_bytes == 5 * 64
    sd2 = {**sd, K: sd[K] + 1}
    h2 = _sync(writer, sd2, 2)
    assert h2.changed_at == {**dict.fromkeys(sd, 1), K: 2}
    assert h2.sent_bytes == 64  # the one tensor that changed (one slot: it holds sync 1)
    reader = SharedMemoryReader()
    fresh = _read(reader, h2, held=0)  # an engine at the checkpoint (and a new layout) takes everything
    assert list(fresh) == list(sd2) and all(torch.equal(fresh[n], sd2[n]) for n in sd2)
    behind = _read(reader, h2, held=1)  # one sync behind: the changed k, with q and v (one fused group)
    assert list(behind) == [Q, K, V] and torch.equal(behind[K], sd[K] + 1)


def test_two_slots_alternate_and_each_gets_what_it_missed(writer):
    sd = _export()
    h1 = _sync(writer, sd, 1, slots=2)
    reader = SharedMemoryReader()
    assert list(_read(reader, h1, held=0)) == list(sd)
    sd2 = {**sd, OPROJ: sd[OPROJ] * 2}
    h2 = _sync(writer, sd2, 2, slots=2)
    assert h1.segment != h2.segment and writer.slot_version == [2, 1]  # sync v in slot v % 2
    assert h2.sent_bytes == 5 * 64  # slot 0 held nothing: everything
    sd3 = {**sd2, "embed": sd2["embed"] - 1}
    h3 = _sync(writer, sd3, 3, slots=2)
    assert h3.segment == h1.segment and writer.slot_version == [2, 3]
    assert h3.sent_bytes == 2 * 64  # slot 1 held sync 1: o (changed at 2) and embed (changed at 3)
    got = _read(reader, h3, held=1)  # the same engine, two syncs behind
    assert (
        list(got) == ["embed", OPROJ]
        and torch.equal(got[OPROJ], sd[OPROJ] * 2)
        and torch.equal(got["embed"], sd3["embed"])
    )
    with pytest.raises(RuntimeError, match="holds the weights of sync 3 .* this load needs sync 1"):
        _read(reader, h1, held=0)  # sync 1's slot was overwritten by sync 3: refused, not half-read


def test_a_stream_that_leaves_the_layout_fails_and_the_next_sync_is_whole(writer):
    sd = _export()
    _sync(writer, sd, 1)
    handle = SyncHandle(version=2, node_id="local", buffer_bytes=1 << 20)
    stream = writer.open(specs_of(sd), handle, SyncRequest(buffer_bytes=1 << 20))
    stream.add("embed", sd["embed"])
    with pytest.raises(RuntimeError, match=rf"streamed '{OPROJ}' \(4, 4\) float32 where the layout expects \('{Q}'"):
        stream.add(OPROJ, sd[OPROJ])
    stream.abort()
    assert handle.segment is None and writer.slot_version == [0]  # the slot is marked partly written
    h3 = _sync(writer, sd, 3)
    assert h3.sent_bytes == 5 * 64  # rewritten whole
    stream = writer.open(specs_of(sd), SyncHandle(version=4, node_id="local", buffer_bytes=1), SyncRequest(1))
    stream.add("embed", sd["embed"])
    with pytest.raises(RuntimeError, match=rf"ended before 4 tensor\(s\) of its layout \(first '{Q}'\)"):
        stream.close()
