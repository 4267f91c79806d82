"""The driver's weight ledger (``rl_plugin.weight_sync.ledger``) through the calls of a sync:
request -> published -> give -> loaded, the versions it asks for, the fingerprints it compares, and
its timings. The settings are a plain namespace of the four fields the ledger reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_plugin.errors import LoopError, WeightSyncError, WeightVersionError
from rl_plugin.weight_sync.handle import GroupSpec, SyncHandle
from rl_plugin.weight_sync.ledger import WeightLedger


def _ledger(transport="auto", fingerprint=False, slots=1):
    return WeightLedger(SimpleNamespace(buffer_bytes=512, transport=transport, fingerprint=fingerprint, slots=slots))


def _handle(version, **kw):
    return SyncHandle(version=version, node_id="n0", buffer_bytes=512, **kw)


def test_a_sync_round_asks_for_the_changes_since_what_the_engines_hold():
    ledger, asked = _ledger(slots=2), []
    nodes = lambda: asked.append(1) or ["n0", "n1"]  # noqa: E731
    first = ledger.request(nodes)
    assert first.since_version is None and first.buffer_bytes == 512 and first.slots == 2 and first.group is None
    assert first.engine_nodes == ("n0", "n1")
    ledger.published(_handle(1, export_seconds=0.5, publish_seconds=0.25))
    assert ledger.give().version == 1 and ledger.engine_version == 1
    assert ledger.give() is None  # nothing newer: the engines hold the newest weights
    ledger.loaded(None)  # the call given nothing answers nothing
    assert ledger.request(nodes).since_version == 1 and len(asked) == 1  # nodes asked once per manager
    ledger.fresh_engines()
    assert ledger.request(nodes).since_version is None and len(asked) == 2 and ledger.epoch == 1


def test_loaded_checks_every_engines_fingerprint_and_counts_its_time():
    ledger = _ledger(fingerprint=True)
    ledger.published(_handle(3, fingerprint={"w": "aa"}, export_seconds=1.0, publish_seconds=2.0))
    ledger.give()
    ledger.loaded({"seconds": 0.5, "versions": [3, 3], "fingerprints": [{"w": "aa"}, {"w": "aa"}]})
    assert ledger.timings() == {"time/weight_sync": 3.5, "time/weight_publish": 3.0, "time/weight_load_engines": 0.5}
    assert ledger.timings() == dict.fromkeys(("time/weight_sync", "time/weight_publish", "time/weight_load_engines"), 0)
    ledger.published(_handle(4, fingerprint={"w": "aa"}))
    ledger.give()
    with pytest.raises(WeightSyncError, match=r"^rollout engine 1: --check-weight-sync: .* at 'w'"):
        ledger.loaded({"seconds": 0.1, "versions": [4, 4], "fingerprints": [{"w": "aa"}, {"w": "bb" * 6}]})
    ledger.published(_handle(5))
    ledger.give()
    with pytest.raises(LoopError, match="was given sync 5 and answered no load"):
        ledger.loaded(None)


def test_an_engine_on_another_version_is_named_before_its_fingerprint_is_compared():
    ledger = _ledger(fingerprint=True)
    ledger.published(_handle(2, fingerprint={"w": "aa"}))
    ledger.give()
    with pytest.raises(WeightVersionError) as err:  # engine 1 kept sync 1 (and its weights)
        ledger.loaded({"seconds": 0.1, "versions": [2, 1], "fingerprints": [{"w": "aa"}, {"w": "bb" * 6}]})
    assert str(err.value) == (
        "rollout engine 1 holds weight version 1, the trainer's is 2: the engine did not load the sync"
    )
    assert isinstance(err.value, WeightSyncError)
    plain = _ledger()  # without --check-weight-sync / --ci-test nothing is compared
    plain.published(_handle(2))
    plain.give()
    plain.loaded({"seconds": 0.1})


def test_a_full_sync_of_its_own_is_not_a_rollouts_cost():
    ledger = _ledger()
    ledger.published(_handle(2))
    ledger.synced_fully(_handle(7), {"seconds": 9.0})
    assert ledger.engine_version == 7 and ledger.last_version == 7 and ledger.unsent is None
    assert ledger.timings()["time/weight_load_engines"] == 0.0


def test_distributed_announces_the_next_version_in_its_group():
    ledger = _ledger(transport="distributed", fingerprint=True)
    ledger.rendezvous = ("10.0.0.1", 2950)
    request = ledger.request(lambda: ["a", "b", "c"])
    assert request.group == GroupSpec(host="10.0.0.1", port=2950, world=4, epoch=0)
    ledger.published(_handle(3))
    ledger.give()
    ledger.loaded({"seconds": 0.0, "versions": [], "fingerprints": []})
    announced = ledger.announce(request)
    assert announced.version == 4 and announced.group == request.group and announced.fingerprint == {}
    ledger.failed(_handle(4, error="member died"))  # the version is used up; the next is 5
    assert ledger.announce(request).version == 5
    assert _ledger().announce(request) is None  # other transports publish first, then the handle is given
