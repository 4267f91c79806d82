"""The prompts a source draws from: the re-queued records first, then the dataset's next ones.

Re-queued records are prompts taken from the dataset and not trained on: a fully-async
checkpoint's (``async_requeue``: buffered, in flight or re-queued when it was written; a resumed
run trains them first whatever its mode), or a group the fully-async buffer dropped as stale under
``--async-unused-samples-handler retry``. The state a checkpoint saves is the manager's form,
``{"train_dataset": <position>}``, plus ``"async_requeue": [record index, ...]`` when records wait
(given ``pending``: the records a caller holds besides, e.g. the fully-async worker's in flight and
buffered, listed after the queue's own).

Not thread-safe by itself: the fully-async worker calls it under its lock.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List, Sequence

from rl_plugin.rollout.data.dataset import PromptDataset, PromptRecord


class PromptQueue:
    def __init__(self, dataset: PromptDataset):
        self.dataset = dataset
        self.requeued: Deque[PromptRecord] = collections.deque()

    def next_batch(self, n: int) -> List[PromptRecord]:
        """``n`` records: the re-queued ones first (oldest first), then the dataset's next."""
        recs = [self.requeued.popleft() for _ in range(min(n, len(self.requeued)))]
        if len(recs) < n:
            recs += self.dataset.next_batch(n - len(recs))
        return recs

    def requeue(self, record: PromptRecord) -> None:
        self.requeued.append(record)

    def state_dict(self, pending: Sequence[PromptRecord] = ()) -> Dict[str, Any]:
        state: Dict[str, Any] = {"train_dataset": self.dataset.state_dict()}
        waiting = list(self.requeued) + list(pending)
        if waiting:
            state["async_requeue"] = [r.index for r in waiting]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["train_dataset"])
        by_index = {r.index: r for r in self.dataset.records}
        self.requeued = collections.deque(by_index[i] for i in state.get("async_requeue", []))
