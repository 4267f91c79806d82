"""The overlapped schedule (``--max-weight-staleness 1``; miles' name, slime's ``train_async.py``)::

    submit generate(k+1)   loading first the weights after rollout k-1
    train(k)               at the same time, on the trainer; publishes the weights after k
    wait for generate(k+1) the engine is never updated mid-generation: the weights after k are
                           loaded by generate(k+2) (or the eval after rollout k)

The publish of sync v and the load of sync v - 1 run at the same time: the shared-memory segment
is double-buffered (``SyncSettings.slots = 2``, ``rl_plugin.weight_sync.shared_memory``).

Rollout k+1 is then trained on at the next iteration by weights one rollout newer than those
that sampled it (staleness 1); the trainer's old log-probs are recomputed on its current weights
and the engine's log-probs describe the sampler, so ``--use-tis`` corrects the lag and the
``mismatch/*`` metrics measure it. The first rollout of a run (or of a resume from a synchronous
checkpoint) is generated in place, by the current weights. The schedule owns the rollout
generated ahead (``PendingRollout``) until its train call returns; a checkpoint holds it
(``pending_rollout.pt``), so a resumed run trains on exactly what the uninterrupted one would have.
A generate ahead that fails (or that an exit signal cut) ends the rollout with its steps logged.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.errors import LoopError
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.schedule import RolloutLoop


class OverlappedSchedule:
    def __init__(self, loop: RolloutLoop, cfg: LoopConfig):
        self._loop, self._cfg = loop, cfg
        self._pending: Optional[PendingRollout] = None  # rollout k+1, generated while k trained

    def pending(self) -> Optional[PendingRollout]:
        return self._pending

    def resume(self, pending: Optional[PendingRollout]) -> None:
        self._pending = pending

    def run_rollout(self, k: int) -> None:
        loop, cfg = self._loop, self._cfg
        t0 = time.perf_counter()
        wait_gen, call = 0.0, None
        if self._pending is None:
            self._pending = PendingRollout(k, loop.generate(k), 0)
            call = wait_gen = time.perf_counter() - t0
        staleness, data = self._pending.staleness, self._pending.data_for(k)
        ahead = None
        if k + 1 < cfg.num_rollout:
            restarts = loop.manager_restarts()
            ahead = loop.submit_generate(k + 1)
        t1 = time.perf_counter()
        # a failure here ends the run; the teardown kills the generating actor
        reports = loop.train_rollout(data, sync=cfg.sync_due(k, ahead=1))
        self._pending = None  # trained on: a checkpoint from now on holds rollout k + 1 (once generated)
        t_train = time.perf_counter() - t1
        timings: Dict[str, float] = {}
        if ahead is not None:
            t2 = time.perf_counter()
            try:
                nxt = loop.wait_generate(k + 1, ahead)
            except LoopError:
                loop.log_steps(k, data, reports, {"time/train": t_train}, t0, staleness)
                raise  # the steps done stay logged
            wait_gen += time.perf_counter() - t2
            # a manager that died meanwhile was replaced and synced with the trainer's current weights
            # (the full sync supersedes the handle train(k) published): no lag
            self._pending = PendingRollout(k + 1, nxt, 0 if loop.manager_restarts() > restarts else 1)
            ahead_s = nxt.stats.get("rollout_gen_time", 0.0) + nxt.stats.get("rollout_reward_time", 0.0)
            timings.update(
                {
                    # the engine's own time on rollout k+1 (generate + reward)
                    "time/generate_ahead": ahead_s,
                    # the engine idle until training ended (approx.)
                    "time/engine_wait_trainer": max(0.0, t2 - t1 - ahead_s),
                    # generation hidden behind training
                    "time/overlap_saved": max(0.0, ahead_s - (time.perf_counter() - t2)),
                }
            )
        timings["time/trainer_wait_generate"] = wait_gen
        if call is not None:
            timings["time/rollout_call"] = call
        timings.update({"time/train": t_train, **loop.sync_timings()})
        loop.finish_rollout(k, data, reports, timings, t0, staleness=staleness)
