"""The prompt queue (``rl_plugin.rollout.data.prompt_queue``): re-queued records first (oldest
first), then the dataset's next; its checkpoint state lists the waiting record indices (the queue's
own, then the caller's ``pending``) and a resumed queue re-queues exactly those records."""

from __future__ import annotations

from rl_plugin.rollout.data.dataset import PromptDataset, PromptRecord
from rl_plugin.rollout.data.prompt_queue import PromptQueue


def _dataset(n: int = 5) -> PromptDataset:
    return PromptDataset([PromptRecord(prompt=f"p{i}", label=str(i), index=i) for i in range(n)])


def test_requeued_records_come_first_oldest_first_then_the_dataset():
    q = PromptQueue(_dataset())
    first = q.next_batch(3)
    assert [r.index for r in first] == [0, 1, 2]
    q.requeue(first[2])
    q.requeue(first[0])
    # two re-queued (2 then 0), then the dataset's next (3, 4), then the next epoch wraps to 0
    assert [r.index for r in q.next_batch(5)] == [2, 0, 3, 4, 0]
    assert not q.requeued
    assert q.dataset.state_dict() == {"epoch": 1, "offset": 1}


def test_a_batch_smaller_than_the_queue_leaves_the_rest_waiting():
    q = PromptQueue(_dataset())
    for r in q.next_batch(4):
        q.requeue(r)
    assert [r.index for r in q.next_batch(3)] == [0, 1, 2]
    assert [r.index for r in q.requeued] == [3]
    assert q.dataset.state_dict() == {"epoch": 0, "offset": 4}  # the dataset was not read


def test_state_lists_the_waiting_records_and_a_resumed_queue_trains_them_first():
    q = PromptQueue(_dataset())
    recs = q.next_batch(4)
    assert q.state_dict() == {"train_dataset": {"epoch": 0, "offset": 4}}  # nothing waits: no key
    q.requeue(recs[1])
    state = q.state_dict(pending=[recs[3], recs[0]])
    assert state == {"train_dataset": {"epoch": 0, "offset": 4}, "async_requeue": [1, 3, 0]}

    resumed = PromptQueue(_dataset())
    resumed.load_state_dict(state)
    assert [r.index for r in resumed.requeued] == [1, 3, 0]
    assert [r.prompt for r in resumed.next_batch(5)] == ["p1", "p3", "p0", "p4", "p0"]


def test_a_state_without_requeued_records_resumes_the_position_only():
    q = PromptQueue(_dataset())
    q.requeue(_dataset().records[2])
    q.load_state_dict({"train_dataset": {"epoch": 2, "offset": 3}})
    assert not q.requeued
    assert [r.index for r in q.next_batch(2)] == [3, 4]
