"""The object-store transport (``rl_plugin.weight_sync.object_store``): buckets of
``plan_buckets``'s cut, put as they fill while the export streams, only the groups changed since
the engines' version (with the shared-memory writer's ``changed_at``), and its refusals: a tensor
not in the specs or streamed twice, an export that ends early, an engine holding another version.
One local Ray (``ray.put`` / ``ray.get`` are the transport)."""

from __future__ import annotations

import pytest
import ray
import torch

from rl_plugin.weight_sync.buckets import plan_buckets, tensor_bytes
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.object_store import ObjectStoreReader, ObjectStoreWriter
from rl_plugin.weight_sync.transport import specs_of
from tests.support.local_ray import local_ray_cluster

L0 = "model.layers.0"


def _state():
    """fp32 tensors in export order; q/k/v of layer 0 travel as one group (24 + 8 + 8 bytes)."""
    return {
        "model.embed.weight": torch.arange(4, dtype=torch.float32),  # 16 bytes
        f"{L0}.self_attn.q_proj.weight": torch.full((6,), 1.0),
        f"{L0}.self_attn.k_proj.weight": torch.full((2,), 2.0),
        f"{L0}.self_attn.v_proj.weight": torch.full((2,), 3.0),
        f"{L0}.mlp.down_proj.weight": torch.full((3,), 4.0),  # 12 bytes
        "lm_head.weight": torch.full((5,), 5.0),  # 20 bytes
    }


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache"), num_cpus=1):
        yield


def _read(handle, held=0):
    return list(ObjectStoreReader().buckets(handle, held))


def test_buckets_are_plan_buckets_cut_and_carry_every_tensor(local_ray):
    sd = _state()
    handle = SyncHandle(version=1, node_id="n", buffer_bytes=40)
    ObjectStoreWriter().write(sd, handle, SyncRequest(buffer_bytes=40))
    buckets = _read(handle)
    want = plan_buckets({n: tensor_bytes(t) for n, t in sd.items()}, 40)
    assert [list(b) for b in buckets] == want
    assert want == [["model.embed.weight"], [f"{L0}.self_attn.{p}_proj.weight" for p in "qkv"], [f"{L0}.mlp.down_proj.weight", "lm_head.weight"]]  # fmt: skip
    assert all(torch.equal(b[n], sd[n]) for b in buckets for n in b)
    assert handle.object_since is None and handle.sent_bytes == 16 + 40 + 32  # no segment: everything, always
    assert ObjectStoreReader().serves(handle, "any node")
    assert not ObjectStoreReader().serves(SyncHandle(version=1, node_id="n", buffer_bytes=40), "n")


def test_a_full_bucket_is_put_before_the_export_ends(local_ray):
    sd = _state()
    handle = SyncHandle(version=1, node_id="n", buffer_bytes=16)
    stream = ObjectStoreWriter().open(specs_of(sd), handle, SyncRequest(buffer_bytes=16))
    names = list(sd)
    stream.add(names[0], sd[names[0]])
    assert stream.refs == []  # the bucket (16 of 16 bytes) is put when the next group does not fit
    for n in names[1:3]:
        stream.add(n, sd[n])
    assert stream.refs == []  # q and k arrived, v not yet: the group waits whole
    stream.add(names[3], sd[names[3]])
    assert len(stream.refs) == 1 and list(ray.get(stream.refs[0])) == ["model.embed.weight"]
    for n in names[4:]:
        stream.add(n, sd[n])
    stream.close()
    assert [len(b) for b in _read(handle)] == [1, 3, 1, 1] and handle.sent_bytes == 16 + 40 + 12 + 20


def test_only_groups_changed_since_the_engines_version_travel(local_ray):
    sd = _state()
    changed = {n: 1 for n in sd} | {f"{L0}.self_attn.v_proj.weight": 3, "lm_head.weight": 2}
    handle = SyncHandle(version=3, node_id="n", buffer_bytes=1 << 20, segment="/rl_plugin_seg", changed_at=changed)
    ObjectStoreWriter().write(sd, handle, SyncRequest(buffer_bytes=1 << 20, since_version=1))
    (bucket,) = _read(handle, held=1)
    assert list(bucket) == [f"{L0}.self_attn.{p}_proj.weight" for p in "qkv"] + ["lm_head.weight"]  # v's group whole
    assert handle.object_since == 1 and handle.sent_bytes == 40 + 20
    with pytest.raises(
        RuntimeError,
        match=r"^weight sync: this engine holds sync 2 but the object store carries the changes since sync 1; "
        r"the driver must request a full sync \(since_version None\)$",
    ):
        _read(handle, held=2)


def test_a_stream_that_breaks_its_specs_is_refused():
    """No Ray needed: nothing is put before the first bucket fills."""
    sd = _state()
    names = list(sd)

    def stream(budget=1 << 20):
        handle = SyncHandle(version=1, node_id="n", buffer_bytes=budget)
        return ObjectStoreWriter().open(specs_of(sd), handle, SyncRequest(buffer_bytes=budget))

    with pytest.raises(ValueError, match=r"^--update-weight-buffer-size must be >= 1 byte \(got 0\)$"):
        stream(0)
    s = stream()
    with pytest.raises(RuntimeError, match=r"streamed 'extra.weight', which its specs do not list \(or twice\)"):
        s.add("extra.weight", torch.zeros(1))
    s.add(names[1], sd[names[1]])
    with pytest.raises(RuntimeError, match=r"streamed 'model.layers.0.self_attn.q_proj.weight', which its specs"):
        s.add(names[1], sd[names[1]])
    s = stream()
    s.add(names[0], sd[names[0]])
    with pytest.raises(
        RuntimeError,
        match=r"^weight sync: the export ended before 'model.layers.0.self_attn.q_proj.weight' \(and 2 more group\(s\)\) of its specs arrived$",
    ):
        s.close()
    s.abort()
    assert (s.refs, s.bucket, s.arrived) == ([], {}, {})
