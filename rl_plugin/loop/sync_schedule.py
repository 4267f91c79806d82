"""The synchronous schedule (``--max-weight-staleness 0``, the default; slime's ``train.py``)::

    generate(k)     the engines load the weights rollout k-1's train call published, then sample
    train(k)        old/ref log-probs, the optimizer steps; the ranks then export and rank 0
                    publishes the new weights (when a later call will load them)
    log, save, eval

Every rollout is sampled by the trainer's current weights (on-policy up to the engine's kernels).
Resumed from an overlapped run's checkpoint, the rollout that checkpoint generated ahead is
trained on first, as it was; nothing is generated ahead after it. A rollout generated but not
yet trained on is ``pending()`` until its train call returns: a checkpoint written meanwhile (an
exit signal stopped that call before its first step) holds it, so a resumed run trains on it.
"""

from __future__ import annotations

import time
from typing import Optional

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.schedule import RolloutLoop


class SyncSchedule:
    def __init__(self, loop: RolloutLoop, cfg: LoopConfig):
        self._loop, self._cfg = loop, cfg
        self._pending: Optional[PendingRollout] = None  # generated, not yet trained on (or a checkpoint's)

    def pending(self) -> Optional[PendingRollout]:
        return self._pending

    def resume(self, pending: Optional[PendingRollout]) -> None:
        self._pending = pending

    def run_rollout(self, k: int) -> None:
        """Rollout k: generate (loading the published weights first), train on it and publish."""
        loop = self._loop
        t0 = time.perf_counter()
        if self._pending is None:
            self._pending = PendingRollout(k, loop.generate(k), 0)
        data = self._pending.data_for(k)
        t_gen = time.perf_counter() - t0
        t1 = time.perf_counter()
        reports = loop.train_rollout(data, sync=self._cfg.sync_due(k, ahead=0))
        self._pending = None
        t_train = time.perf_counter() - t1
        timings = {"time/rollout_call": t_gen, "time/train": t_train, **loop.sync_timings()}
        loop.finish_rollout(k, data, reports, timings, t0)
