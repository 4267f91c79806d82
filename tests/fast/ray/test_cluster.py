"""Another Ray cluster on the node (issue 38 item 9): with no ``RAY_ADDRESS`` the run starts a
private local cluster (``rl_plugin.ray.cluster.init_ray``) even when a ``ray start --head`` runs.

Before: Ray's plain ``ray.init()`` found the head's address file and joined it, then refused the
``num_cpus`` the run passes (``ValueError: When connecting to an existing cluster, num_cpus and
num_gpus must not be provided``), ~2 s in.

The test starts a real head (``ray start --head --block``, in its own session so that the whole
cluster is killed by its process group in ``finally``) under a private ``RAY_TMPDIR``, so the
address file it writes reaches no other Ray user of this machine, then runs ``init_ray`` in a
subprocess with the same ``RAY_TMPDIR``: it must start a cluster of its own (another GCS address,
the CPUs it asked for) and leave the head running."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

RAY = Path(sys.executable).parent / "ray"
START_S = 90  # generous: ~5 s on an idle 2-core machine

CHILD = """
import ray
from rl_plugin.ray.cluster import init_ray, shutdown_ray
try:
    init_ray(2)
    print("GCS", ray.get_runtime_context().gcs_address, int(ray.cluster_resources().get("CPU", 0)), flush=True)
finally:
    shutdown_ray()
"""


def _stop(head: subprocess.Popen) -> None:
    """SIGKILL the head's process group: the head and every process it started (its own session;
    a SIGTERM would have the head drain for up to 30 s)."""
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(30)


@pytest.mark.skipif(not RAY.exists(), reason="the ray CLI is not installed beside this Python")
def test_run_starts_its_own_cluster_beside_a_ray_start_head(free_port):
    tmp = Path(tempfile.mkdtemp(prefix="rlp38-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(tmp), PYTHONPATH=os.getcwd() + os.pathsep + env.get("PYTHONPATH", ""))
    port = free_port()
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1"]
        + ["--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        address_file = tmp / "ray" / "ray_current_cluster"  # what Ray's plain ray.init() would join
        deadline = time.monotonic() + START_S
        while not address_file.exists() and head.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert address_file.exists(), f"ray start --head did not come up (rc {head.poll()})"
        head_address = address_file.read_text().strip()
        out = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=3 * START_S
        )
        assert out.returncode == 0, out.stderr[-3000:]
        _, gcs, cpus = next(line for line in out.stdout.splitlines() if line.startswith("GCS ")).split()
        assert gcs != head_address and int(cpus) == 2, (gcs, head_address, cpus)  # its own cluster, its own CPUs
        assert head.poll() is None  # the other cluster is untouched
        assert address_file.read_text().strip() == head_address
    finally:
        _stop(head)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_critics_processes_and_shares():
    """PPO's critic (issue 47): its own ranks count towards the local cluster's CPUs when
    disaggregated; colocated, the actor's and the critic's process split the training share of a
    bundle, so a bundle's four processes still sum to one."""
    from rl_plugin.ray.bundle_order import BundleSite
    from rl_plugin.ray.cluster import COLOCATED_TRAIN_SHARE, Placement, own_critic_ranks, required_cpus
    from tests.support.placement import placement_config

    apart = dict(actor_num_nodes=1, colocate=False, advantage_estimator="ppo")
    assert required_cpus(placement_config(actor_num_nodes=1, colocate=False)) == 2 + 1  # ranks + the manager
    assert own_critic_ranks(placement_config(**apart)) == 2  # the actor's size by default
    assert required_cpus(placement_config(**apart, critic_num_gpus_per_node=3)) == 2 + 1 + 3
    together = placement_config(advantage_estimator="ppo")
    assert own_critic_ranks(together) == 0 and required_cpus(together) == 4  # on the actor's bundles

    sites = [BundleSite(b, f"n{b // 2}", "127.0.0.1") for b in (1, 0, 3, 2)]
    p = Placement(None, 4, True, True, 1, [1, 3], train_bundles=[1, 0, 3, 2], train_sites=sites)
    assert p.train_share == COLOCATED_TRAIN_SHARE and p.train_options(0)["num_gpus"] == COLOCATED_TRAIN_SHARE
    with pytest.raises(ValueError, match="holds no critic"):
        p.for_critic()
    p.critic_bundles, p.critic_sites = list(p.train_bundles), list(sites)  # colocated: the actor's bundles
    critic = p.for_critic()
    assert (critic.world_size, critic.train_bundles, critic.train_sites) == (4, [1, 0, 3, 2], sites)
    half = COLOCATED_TRAIN_SHARE / 2
    assert p.train_share == critic.train_share == half
    manager, engine = p.rollout_options(1)["num_gpus"], p.engine_options(0)["num_gpus"]
    assert 2 * half + manager + engine == 1.0  # rank 0's bundle: actor, critic, manager, engine
    own = Placement(None, 2, True, False, 2, train_bundles=[0, 1], critic_bundles=[4, 3], critic_sites=sites[:2])
    assert own.for_critic().train_options(1)["num_gpus"] == 1.0  # a bundle of its own: all of it
    assert own.for_critic().train_options(1)["scheduling_strategy"].placement_group_bundle_index == 3
