"""The synchronous schedule (``--max-weight-staleness 0``, the default; slime's ``train.py``)::

    generate(k)     the engines load the weights rollout k-1's train call published, then sample
    train(k)        old/ref log-probs, the optimizer steps; the ranks then export and rank 0
                    publishes the new weights (when a later call will load them)
    log, save, eval

Every rollout is sampled by the trainer's current weights (on-policy up to the engine's kernels).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver picks its schedule: no import at run time
    from rl_plugin.loop.driver import Driver


def run_sync_rollout(driver: Driver, k: int) -> None:
    """Rollout k: generate (loading the published weights first), train on it and publish."""
    t0 = time.perf_counter()
    data = driver.generate(k) if driver.pending is None else driver.take_pending(k)
    t_gen = time.perf_counter() - t0
    t1 = time.perf_counter()
    reports = driver.train_rollout(data, sync=driver.cfg.sync_due(k, ahead=0))
    t_train = time.perf_counter() - t1
    timings = {"time/rollout_call": t_gen, "time/train": t_train, **driver.ledger.timings()}
    driver.finish_rollout(k, data, reports, timings, t0)
