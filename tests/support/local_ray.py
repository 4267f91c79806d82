"""A local Ray cluster for one test module: auth off, no dashboard, a small object store, and
``RL_PLUGIN_CACHE`` (the embedded model and task) in a temporary directory, restored afterwards.
Starting Ray is the slow part of an end-to-end test, so a module starts it once."""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def local_ray_cluster(cache_dir, num_cpus: int = 4):
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    previous = os.environ.get("RL_PLUGIN_CACHE")
    os.environ["RL_PLUGIN_CACHE"] = str(cache_dir)
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=256 * 1024 * 1024)
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("RL_PLUGIN_CACHE")
        else:
            os.environ["RL_PLUGIN_CACHE"] = previous
