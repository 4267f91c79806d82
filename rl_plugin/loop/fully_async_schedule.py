"""The fully asynchronous schedule (``--fully-async``; miles' name)::

    take(k)     the rollout manager's worker generates all along (``rollout.fully_async``); the
                weights published after rollout k-1 are loaded at its next token boundary (requests
                in flight continue under them: partial rollouts), then ``--rollout-batch-size``
                groups are taken from its buffer, the staler than ``--max-weight-staleness`` dropped
    train(k)    meanwhile the worker keeps generating with the weights it holds; the train call
                publishes the new weights every ``--update-weights-interval`` rollouts (and before
                an eval)
    log, save, eval (the eval pauses the worker at a token boundary; nothing is aborted)

The trainer's weight version is the rollout index: rollout k trains weights of version k, a token
carries the version of the weights that drew it, and a group's staleness is k minus its oldest
token's version (``async/staleness_*``). A checkpoint drops the buffer: the prompts taken from the
dataset but not yet in a rollout (buffered, in flight, re-queued) are in the manager's dataset
state (``async_requeue``), so a resumed run generates them again first, with its weights. A
rollout taken and not yet trained on (an exit signal stopped its train call) is ``pending()``, kept
by the checkpoint and trained on first after a resume, as the overlapped schedule's is.
"""

from __future__ import annotations

import time
from typing import Optional

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.schedule import RolloutLoop


class FullyAsyncSchedule:
    def __init__(self, loop: RolloutLoop, cfg: LoopConfig):
        self._loop, self._cfg = loop, cfg
        self._pending: Optional[PendingRollout] = None  # an overlapped checkpoint's, trained on first

    def pending(self) -> Optional[PendingRollout]:
        return self._pending

    def resume(self, pending: Optional[PendingRollout]) -> None:
        self._pending = pending

    def publish_due(self, k: int) -> bool:
        """Whether rollout k's train call publishes: every --update-weights-interval rollouts while
        a later take loads them, and before an eval."""
        cfg = self._cfg
        interval_due = (k + 1) % max(1, cfg.update_weights_interval) == 0 and k + 1 < cfg.num_rollout
        return cfg.eval_due(k) or interval_due

    def run_rollout(self, k: int) -> None:
        loop = self._loop
        t0 = time.perf_counter()
        if self._pending is None:  # taken, not trained on yet: a checkpoint written meanwhile holds it
            self._pending = PendingRollout(k, loop.take(k), 0)
        data = self._pending.data_for(k)
        t_take = time.perf_counter() - t0
        t1 = time.perf_counter()
        reports = loop.train_rollout(data, sync=self.publish_due(k))
        self._pending = None
        timings = {
            "time/trainer_wait_generate": t_take,
            "time/rollout_call": t_take,
            "time/train": time.perf_counter() - t1,
            **loop.sync_timings(),
        }
        loop.finish_rollout(k, data, reports, timings, t0)
