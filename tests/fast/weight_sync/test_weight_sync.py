"""The weight sync's publisher and receiver (``rl_plugin.weight_sync``) with a real HF
engine: a shared-memory sync leaves the engine bitwise equal to the trainer's export
(``--check-weight-sync``'s sha256 fingerprints), later syncs move only the tensors that changed
(a fused q/k/v group whole), tied weights are not sent, the object store carries the changes for
an engine on another node, and the bad states (segment missing, overwritten mid-load, dead
creator) fail loud or are cleaned up. Double buffering (overlapped training): a load of sync
v - 1 is never overwritten by the publish of v, and each slot gets everything changed since the
sync it holds. The loop's end-to-end runs (``e2e/test_loop``,
``e2e/test_loop_vllm``) sync through the same code with ``--check-weight-sync`` on both backends and
both engines."""

import os
import subprocess
import sys

import pytest
import torch

from rl_plugin.models.tiny import make_tiny_hf_checkpoint
from rl_plugin.rollout.engines.hf_engine import HFEngine
from rl_plugin.weight_sync import (
    SyncRequest,
    WeightPublisher,
    WeightReceiver,
    changed_bitwise,
    load_sync,
    weights_fingerprint,
)
from rl_plugin.weight_sync.segment import SEGMENT_PREFIX, SharedWeightSegment, WeightLayout, sweep_stale

QKV = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    ck = make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("ws") / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64
    )
    return HFEngine(str(ck))


def _perturbed(sd, seed, names=None):
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v + 0.01 * torch.randn(v.shape, generator=g)) if names is None or k in names else v.clone()
        for k, v in sd.items()
    }


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_shared_memory_sync_is_bitwise_and_moves_only_what_changed(engine):
    start = {k: v.clone() for k, v in engine.weights().items()}
    pub, recv = WeightPublisher("shared_memory"), WeightReceiver()
    req = SyncRequest(buffer_bytes=4096, transport="shared_memory", fingerprint=True)
    try:
        # sync 1: everything, in buckets of <= 4 KiB (a fused group may exceed it alone)
        new = _perturbed(start, 1)
        handle = pub.publish(new, req)
        assert handle.segment is not None and handle.object_refs is None
        stats = load_sync(engine, recv, handle)
        total = sum(v.numel() * 4 for v in new.values())
        assert stats["bytes"] == total == handle.sent_bytes
        assert stats["fingerprint"] == handle.fingerprint == weights_fingerprint(new)  # bitwise equal
        path, layout = handle.segment, handle.layout

        # sync 2: one norm and one q_proj changed -> those plus k/v of the same layer (fused group)
        q = "model.layers.1.self_attn.q_proj.weight"
        new2 = _perturbed(new, 2, {"model.norm.weight", q})
        handle2 = pub.publish(new2, req)
        assert handle2.segment == path and handle2.layout is layout  # the segment and layout are reused
        sent = sorted(n for n, v in handle2.changed_at.items() if v == 2)
        assert sent == sorted(["model.norm.weight", q])
        loaded = []
        for bucket in recv.buckets(handle2):
            loaded += list(bucket)
            engine.update_weights(bucket)
        group = [n for n in new2 if n.startswith("model.layers.1.self_attn.") and n.split(".")[-2] in QKV]
        assert sorted(loaded) == sorted(["model.norm.weight", *group])
        assert weights_fingerprint(engine.weights()) == weights_fingerprint(new2)

        # sync 3: nothing changed -> nothing written, nothing loaded; sync 4: one ulp is a change
        assert load_sync(engine, recv, pub.publish(new2, req))["bytes"] == 0.0
        new4 = dict(new2, **{"model.norm.weight": new2["model.norm.weight"].clone()})
        new4["model.norm.weight"][1] = torch.nextafter(new2["model.norm.weight"][1], torch.tensor(9.0))
        stats4 = load_sync(engine, recv, pub.publish(new4, req))
        assert stats4["bytes"] == new4["model.norm.weight"].numel() * 4
        assert stats4["fingerprint"] == weights_fingerprint(new4)

        # a fresh receiver (a restarted engine) loads everything from the same segment
        fresh = WeightReceiver()
        assert sum(sum(t.numel() * 4 for t in b.values()) for b in fresh.buckets(pub.publish(new4, req))) == total
    finally:
        pub.close()
    assert not os.path.exists(path)  # close unlinks the segment
    with pytest.raises(FileNotFoundError, match=f"segment {path} is missing"):
        SharedWeightSegment.open(path, layout)


def test_double_buffer_keeps_the_loading_version_and_fills_each_slot_with_what_it_missed():
    """Two slots (``SyncRequest.slots = 2``): sync v in slot v % 2. ``a`` is trained every sync,
    ``b`` frozen, ``c`` changed at sync 2 only. A receiver loading sync 2 bucket by bucket while
    sync 3 is published reads sync 2 to the end; sync 3 lands in the slot that held sync 1, so it
    must also get ``c`` (changed at 2); one slot (the synchronous loop) would fail that load."""
    g = torch.Generator().manual_seed(0)
    sd = {"a.weight": torch.randn(64, generator=g), "b.weight": torch.randn(64, generator=g)}
    sd["c.bias"] = torch.randn(64, generator=g)
    nbytes = 64 * 4

    def step(prev, names):
        return {k: (v + 1.0 if k in names else v.clone()) for k, v in prev.items()}

    req = SyncRequest(buffer_bytes=nbytes, transport="shared_memory", slots=2)  # one tensor per bucket
    pub, recv = WeightPublisher("shared_memory"), WeightReceiver()
    try:
        sd1 = step(sd, ())
        h1 = pub.publish(sd1, req)
        assert h1.sent_bytes == 3 * nbytes  # a fresh slot: everything
        assert {n: t.clone() for b in recv.buckets(h1) for n, t in b.items()}.keys() == sd1.keys()
        sd2 = step(sd1, ("a.weight", "c.bias"))
        h2 = pub.publish(sd2, req)
        assert h2.segment != h1.segment and h2.sent_bytes == 3 * nbytes  # the other slot, fresh
        assert h2.changed_at == {"a.weight": 2, "b.weight": 1, "c.bias": 2}

        loading = recv.buckets(h2)  # the engine loads sync 2 ...
        got = {n: t.clone() for n, t in next(loading).items()}
        sd3 = step(sd2, ("a.weight",))
        h3 = pub.publish(sd3, req)  # ... while the trainer publishes sync 3
        for bucket in loading:
            got.update({n: t.clone() for n, t in bucket.items()})
        assert sorted(got) == ["a.weight", "c.bias"]  # what changed since sync 1, read to the end
        assert all(torch.equal(got[n], sd2[n]) for n in got)
        assert h3.segment == h1.segment and h3.changed_at == {"a.weight": 3, "b.weight": 1, "c.bias": 2}
        assert h3.sent_bytes == 2 * nbytes  # the slot held sync 1: a (changed at 3) and c (changed at 2)
        slot3 = SharedWeightSegment.open(h3.segment, h3.layout)
        slot3.check_version(3)
        assert all(torch.equal(slot3.views[n], sd3[n]) for n in sd3)  # the slot holds sync 3 whole
        assert [n for b in recv.buckets(h3) for n in b] == ["a.weight"]  # the engine at sync 2 needs a only

        sd4 = step(sd3, ())
        h4 = pub.publish(sd4, req)  # nothing changed: the slot that held sync 2 misses a (changed at 3)
        assert h4.segment == h2.segment and h4.sent_bytes == nbytes
        assert h4.changed_at == h3.changed_at and list(recv.buckets(h4)) == []
        assert all(torch.equal(slot3.views[n], sd3[n]) for n in sd3)  # sync 3's slot untouched by sync 4
        late = SharedWeightSegment.open(h2.segment, h2.layout)
        with pytest.raises(RuntimeError, match="holds the weights of sync 4 .* this load needs sync 2"):
            late.check_version(2)  # a reader two syncs behind is caught by the version check
    finally:
        pub.close()

    one = WeightPublisher("shared_memory")  # one slot: the same interleaving is a torn read
    try:
        single = SyncRequest(buffer_bytes=nbytes, transport="shared_memory")
        one.publish(sd1, single)
        loading = WeightReceiver().buckets(one.publish(sd2, single))
        next(loading)
        one.publish(sd3, single)
        with pytest.raises(RuntimeError, match="holds the weights of sync 3 .* this load needs sync 2"):
            list(loading)
    finally:
        one.close()


def test_tied_weights_are_sent_once(tmp_path):
    ck = make_tiny_hf_checkpoint(
        tmp_path / "tied", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64, tie_word_embeddings=True
    )
    eng = HFEngine(str(ck))
    sd = _perturbed(eng.weights(), 3)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # what the trainer exports for a tied model
    pub = WeightPublisher("shared_memory", skip=["lm_head.weight"])
    try:
        handle = pub.publish(sd, SyncRequest(buffer_bytes=1 << 20, transport="shared_memory", fingerprint=True))
        assert "lm_head.weight" not in handle.changed_at
        stats = load_sync(eng, WeightReceiver(), handle)
        assert stats["bytes"] == sum(v.numel() * 4 for k, v in sd.items() if k != "lm_head.weight")
        assert stats["fingerprint"] == handle.fingerprint  # lm_head followed the embedding
    finally:
        pub.close()


def test_a_write_during_a_load_and_a_foreign_segment_fail_loud(tmp_path):
    sd = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
    layout = WeightLayout.of(sd)
    assert [s.offset % 64 for s in layout.slots] == [0, 0]
    seg = SharedWeightSegment.create(layout, directory=tmp_path)
    try:
        reader = SharedWeightSegment.open(str(seg.path), layout)
        seg.views["a.weight"].copy_(sd["a.weight"])
        seg.end_write(7)
        reader.check_version(7)
        assert torch.equal(reader.views["a.weight"], sd["a.weight"])  # the same pages
        seg.begin_write()
        with pytest.raises(RuntimeError, match="holds the weights of sync 0 .* this load needs sync 7"):
            reader.check_version(7)
        other = WeightLayout.of({"a.weight": torch.zeros(2, 3), "c.bias": torch.zeros(5, dtype=torch.bfloat16)})
        with pytest.raises(RuntimeError, match="not the trainer's weight segment for this layout"):
            SharedWeightSegment.open(str(seg.path), other)
    finally:
        seg.close()


def test_segments_of_dead_processes_are_swept(tmp_path):
    dead = _dead_pid()
    stale = tmp_path / f"{SEGMENT_PREFIX}.{dead}.0"
    mine = tmp_path / f"{SEGMENT_PREFIX}.{os.getpid()}.0"
    alive = tmp_path / f"{SEGMENT_PREFIX}.1.0"  # pid 1 runs
    for p in (stale, mine, alive):
        p.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [stale]
    assert mine.exists() and alive.exists()

    from rl_plugin.ray.reaper import WEIGHT_SEGMENTS, remove_weight_segments

    assert WEIGHT_SEGMENTS == ("/dev/shm", SEGMENT_PREFIX)
    if os.path.isdir("/dev/shm"):
        killed = _dead_pid()
        seg = f"/dev/shm/{SEGMENT_PREFIX}.{killed}.0"
        open(seg, "wb").close()
        remove_weight_segments([killed])
        assert not os.path.exists(seg)


def test_changed_bitwise():
    x = torch.randn(10_000)
    assert not changed_bitwise(x, x.clone())
    y = x.clone()
    y[4097] = torch.nextafter(y[4097], torch.tensor(99.0))  # off the strided probe: found by the full compare
    assert changed_bitwise(x, y)
    assert changed_bitwise(torch.zeros(3), torch.tensor([0.0, -0.0, 0.0]))
    nan = torch.tensor([float("nan")])
    assert not changed_bitwise(nan, nan.clone())


def test_object_store_carries_the_changes_for_an_engine_on_another_node(engine, tmp_path):
    from tests.support.local_ray import local_ray_cluster

    with local_ray_cluster(tmp_path, num_cpus=1):
        start = {k: v.clone() for k, v in engine.weights().items()}
        pub, far = WeightPublisher("auto"), WeightReceiver()
        far.node = "another-node"  # as an engine actor on another machine sees itself
        try:
            new = _perturbed(start, 5)
            req = SyncRequest(buffer_bytes=8192, engine_nodes=("another-node",), fingerprint=True)
            h1 = pub.publish(new, req)
            assert h1.segment is not None and h1.object_refs and h1.object_since is None  # both paths
            assert load_sync(engine, far, h1)["fingerprint"] == weights_fingerprint(new)
            new2 = _perturbed(new, 6, {"model.norm.weight"})
            h2 = pub.publish(
                new2, SyncRequest(buffer_bytes=8192, engine_nodes=("another-node",), since_version=1, fingerprint=True)
            )
            stats = load_sync(engine, far, h2)
            assert stats["bytes"] == new2["model.norm.weight"].numel() * 4
            assert stats["fingerprint"] == weights_fingerprint(new2)
            lagging = WeightReceiver()
            lagging.node = "another-node"
            with pytest.raises(
                RuntimeError, match="holds sync 0 but the object store carries the changes since sync 1"
            ):
                list(lagging.buckets(h2))
            # forced shared memory cannot reach another node
            with pytest.raises(RuntimeError, match="shared_memory: rollout engines run on node"):
                WeightPublisher("shared_memory").publish(
                    new2, SyncRequest(buffer_bytes=8192, transport="shared_memory", engine_nodes=("another-node",))
                )
        finally:
            pub.close()
        engine.update_weights(start)


def test_nccl_is_the_distributed_transports_other_name():
    from rl_plugin.arguments import parse_args

    assert parse_args(["--update-weight-transport", "nccl"]).update_weight_transport == "nccl"
    assert WeightPublisher("nccl").dist is not None and WeightPublisher("nccl").shm is None
