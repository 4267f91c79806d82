"""Issue 37 item 9: the rendezvous ports are bound once and held.

Train rank 0 used to find a free port (bind, read, close) and hand it on, to be bound later by the
process group's or the weight sync's store: in between, any process could take it. Now rank 0
hosts each store on a port the kernel picks and keeps it: the port it reports is already bound (a
second bind fails), and creations in parallel never collide.
"""

from __future__ import annotations

import errno
import socket
import threading

import pytest

from rl_plugin.ray.train_actor import TrainActor
from rl_plugin.weight_sync import distributed


def _bind_fails(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        return False


def test_rank0_reports_a_port_its_process_group_store_holds():
    actor = TrainActor(0, 2)
    _, port, _ = actor.address()
    assert port > 0 and _bind_fails(port)  # held from the moment it is reported
    assert actor.address()[1] == port  # asked again: the same store, not a second one


def test_rank0_reports_a_weight_store_port_it_holds():
    actor = TrainActor(0, 1)
    _, port = actor.weight_store_address()
    assert _bind_fails(port)
    assert actor.weight_store_address()[1] == port


@pytest.mark.parametrize("n", [8])
def test_concurrent_stores_never_collide(n):
    ports, errors = [], []

    def make():
        try:
            ports.append(distributed.host_store("127.0.0.1"))
        except Exception as exc:  # noqa: BLE001 - a collision would surface here
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(ports)) == n
    assert all(_bind_fails(p) for p in ports)
