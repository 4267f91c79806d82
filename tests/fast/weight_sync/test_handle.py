"""What travels between driver, train rank 0 and the engines (``rl_plugin.weight_sync.handle``): the
defaults of a request (one shared-memory slot, everything sent), a handle's own change map, and the
node id outside Ray."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from rl_plugin.weight_sync.handle import GroupSpec, SyncHandle, SyncRequest, node_id


def test_node_id_outside_ray_is_local():
    import ray

    assert not ray.is_initialized()
    assert node_id() == "local"


def test_request_defaults_send_everything_through_auto():
    r = SyncRequest(buffer_bytes=1 << 20)
    assert (r.transport, r.engine_nodes, r.since_version, r.fingerprint, r.slots, r.group) == (
        "auto",
        (),
        None,
        False,
        1,
        None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.slots = 2


def test_handles_do_not_share_their_change_maps_and_survive_pickling():
    a, b = SyncHandle(version=1, node_id="n", buffer_bytes=8), SyncHandle(version=2, node_id="n", buffer_bytes=8)
    a.changed_at["w"] = 1
    assert b.changed_at == {}
    a.group = GroupSpec(host="h", port=1, world=3, epoch=2)
    back = pickle.loads(pickle.dumps(a))  # what Ray does to it between the actors
    assert back == a and back.group.world == 3 and back.error is None and back.sent_bytes == 0
