"""A ``RolloutLoop`` without Ray for the schedules' tests (``rl_plugin.loop.schedule``): the
config a schedule reads, a rollout's stand-in and a loop that records every call in order."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from rl_plugin.errors import LoopError
from rl_plugin.loop.schedule import Schedule


class ScheduleCfg:
    """What a schedule reads of ``LoopConfig``: the rollout count and when a train call publishes
    (here: when a later generate loads it; no eval)."""

    def __init__(self, num_rollout: int, interval: int = 1, eval_at=()):
        self.num_rollout, self.update_weights_interval, self.eval_at = num_rollout, interval, set(eval_at)

    def eval_due(self, k: int) -> bool:
        return k in self.eval_at

    def sync_due(self, k: int, ahead: int) -> bool:
        return k + 1 + ahead < self.num_rollout


class FakeData:
    """Stands in for a ``RolloutData``: the schedules read only its ``stats``."""

    def __init__(self, k: int):
        self.k, self.stats = k, {}


class FakeLoop:
    """A ``RolloutLoop`` that records the calls a schedule makes, in order."""

    def __init__(self, restart_while_generating: Optional[int] = None, fail_wait: Optional[int] = None):
        self.calls: List[tuple] = []
        self.restarts = 0
        self.restart_while_generating, self.fail_wait = restart_while_generating, fail_wait
        self.finished: Dict[int, Dict[str, Any]] = {}

    def generate(self, k):
        self.calls.append(("generate", k))
        return FakeData(k)

    def submit_generate(self, k):
        self.calls.append(("submit_generate", k))
        return k

    def wait_generate(self, k, in_flight):
        self.calls.append(("wait_generate", k))
        assert in_flight == k
        if k == self.fail_wait:
            raise LoopError("the manager died too often")
        if k == self.restart_while_generating:
            self.restarts += 1  # a fresh manager, synced with the trainer's current weights
        return FakeData(k)

    def take(self, k):
        self.calls.append(("take", k))
        return FakeData(k)

    def manager_restarts(self):
        return self.restarts

    def local_source(self):
        return None

    def train_rollout(self, data, sync=False, batch=None):
        self.calls.append(("train", data.k, sync))
        return [{"samples": 1}]

    def eval_nll(self, batch):
        return 0.0, 0.0

    def sync_timings(self):
        return {}

    def log_steps(self, k, data, reports, timings, t0, staleness):
        self.calls.append(("log_steps", k, staleness))

    def finish_rollout(self, k, data, reports, timings, t0, staleness=None, evaluate=None):
        self.calls.append(("finish", k, staleness))
        self.finished[k] = timings


def run_rollouts(schedule: Schedule, num_rollout: int, start: int = 0) -> None:
    for k in range(start, num_rollout):
        schedule.run_rollout(k)
