"""Fully async (``--fully-async``): the rollout manager's background worker
(``rollout.fully_async.producer``; its buffer alone is ``test_buffer``) on the real embedded model and ``hf`` engine. A
weight update is what ``take`` does with a handle: the new weights loaded while the worker waits at
a token boundary, the engine's version set (``_update`` below, with perturbed weights)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout import generate_tokens
from rl_plugin.rollout.fully_async.source import take_groups
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.rollout.source import FULLY_ASYNC

HERE = Path(__file__).resolve()


async def versioned_two_turn(args, sample, sampling_params):
    """Two turns with a masked tool turn between (as ``tests/support/turn_hooks.two_turn``), keeping
    every model token's weight version (``output_weight_versions``)."""
    first = await generate_tokens(args, sample.tokens, dict(sampling_params, max_new_tokens=3))
    tool = [3, 11]
    room = dict(sampling_params, max_new_tokens=sampling_params["max_new_tokens"] - 3)  # within the flag: no cut
    second = await generate_tokens(args, sample.tokens + first["output_ids"] + tool, room)
    ids = first["output_ids"] + tool + second["output_ids"]
    # unversioned outside the fully-async worker (an eval's generations)
    v1 = first.get("output_weight_versions", [0] * len(first["output_ids"]))
    v2 = second.get("output_weight_versions", [0] * len(second["output_ids"]))
    sample.tokens = sample.tokens + ids
    sample.response_length = len(ids)
    sample.loss_mask = [1] * len(first["output_ids"]) + [0, 0] + [1] * len(second["output_ids"])
    sample.rollout_log_probs = first["output_log_probs"] + [0.0, 0.0] + second["output_log_probs"]
    sample.weight_versions = v1 + [v1[-1] if v1 else (v2[:1] or [0])[0]] * 2 + v2  # the tool's: not trained
    return sample


@pytest.fixture
def managers():
    """The managers a test made; their workers stopped after it (a worker left running would draw
    from the global RNG under the next test's feet)."""
    made = []
    yield made
    for m in made:
        m.stop()


def _manager(tmp_path, *extra):
    args = parse_train_flags(
        ["--n-samples-per-prompt", "4", "--rollout-batch-size", "4", "--output-dir", str(tmp_path / "out")]
        + ["--fully-async", "--max-weight-staleness", "1", "--rollout-max-response-len", "24"]
        + list(extra)
    )
    prepare_embedded(args)
    settings = LoopConfig.from_args(args).async_settings
    cfg = RolloutConfig.from_args(args)
    return RolloutManager(
        cfg, args.hf_checkpoint, args.prompt_data, None, args=args, source=FULLY_ASYNC, async_settings=settings
    )


def _update(m, version: int) -> None:
    """A weight update as ``take`` loads it: at a token boundary, the version set with it."""
    g = torch.Generator().manual_seed(version)
    with m.source.producer.gate.exclusive():
        with torch.no_grad():
            for p in m.fleet.engine.model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))
        m.source.producer.gate.version = version


def test_every_trained_group_is_within_the_bound_and_retry_regenerates_dropped_prompts(tmp_path, managers):
    m = _manager(tmp_path, "--async-unused-samples-handler", "retry")
    managers.append(m)
    m.generate(0)  # starts the worker at version 0
    p = m.source.producer
    dropped, trained = [], []
    requeue = p.buffer.requeue
    p.buffer.requeue = lambda rec: (dropped.append(rec.index), requeue(rec))
    for k in range(1, 5):
        time.sleep(0.3)  # the worker fills the buffer meanwhile (a train step's time)
        _update(m, k)
        took = take_groups(p, 4, k)
        for g in took["groups"]:
            assert g.staleness(k) <= 1, (k, g.oldest_version)
            assert all(len(s.weight_versions) == s.response_length for s in g.samples)
            trained.append((k, g.record.index))
        assert took["metrics"]["async/staleness_max"] <= 1
    assert dropped, "the buffer held groups older than the bound: some must have been dropped"
    later = {idx for k, idx in trained}
    regenerated = [idx for idx in dropped if idx in later]
    assert regenerated, (dropped, trained)
    state = m.state_dict()  # the prompts taken but not trained on come back on resume
    records = m.generation.prompts.dataset.records
    assert state["async_requeue"] and set(state["async_requeue"]) <= {r.index for r in records}
    fresh = _manager(tmp_path / "b", "--async-unused-samples-handler", "retry")
    fresh.load_state_dict(state)
    assert [r.index for r in fresh.generation.prompts.requeued] == state["async_requeue"]


def test_hook_masks_and_versions_survive_pauses_and_eval_pauses_production(tmp_path, managers):
    m = _manager(tmp_path, "--custom-generate-function-path", f"{HERE}:versioned_two_turn", "--eval-prompt-data", "")
    managers.append(m)
    data = m.generate(0)
    stop = threading.Event()

    def updates():
        v = 1
        while not stop.is_set():
            _update(m, v)
            v += 1
            time.sleep(0.01)

    t = threading.Thread(target=updates)
    t.start()
    try:
        took = take_groups(m.source.producer, 8, m.source.producer.gate.version)
    finally:
        stop.set()
        t.join()
    for g in took["groups"]:
        for s in g.samples:
            mask, v = s.loss_mask, s.weight_versions
            assert len(mask) == len(v) == s.response_length
            first = mask.index(0)
            assert mask[first : first + 2] == [0, 0] and s.tokens[s.prompt_length + first :][:2] == [3, 11]
            assert v == sorted(v)  # versions never go back within a trajectory
    assert data.loss_mask.min() == 0  # the tool turn stays masked in the trained rollout
    pauses = m.source.producer.gate.pauses
    m.generation.eval = m.generation.prompts.dataset  # held-out prompts: any
    out = m.evaluate(0)
    assert m.source.producer.gate.pauses == pauses + 1 and "eval/reward_mean" in out


def test_samples_keep_the_engines_per_token_versions():
    """``build_samples`` carries a pausable generation's versions (else the worker would stamp the
    submission's start version on every token, and no trajectory would count as partial)."""
    from types import SimpleNamespace

    from rl_plugin.rollout.engines.base import Generation
    from rl_plugin.rollout.generation.default import build_samples

    gens = [Generation([1], [4, 5, 6], [-1.0, -1.0, -1.0], True, None, [3, 3, 4]), Generation([1], [7], [-1.0], True)]
    rec = SimpleNamespace(prompt="p", label="l", metadata=None)
    samples = build_samples([rec], gens, ["a", "b"], 2)
    assert samples[0].weight_versions == [3, 3, 4] and samples[1].weight_versions is None


# -- issue 44 item 2: the checkpoint's snapshot is one atomic read ----------------------------------


def test_a_snapshot_never_sees_a_group_both_being_generated_and_buffered(tmp_path, managers):
    """The worker stops right after a group entered the buffer, before it left the submission's
    list (what a thread switch there does); a checkpoint's snapshot taken then must list the prompt
    once (before the fix: twice, so the resumed run trained it twice)."""
    m = _manager(tmp_path, "--rollout-submission-granularity", "group")
    managers.append(m)
    m.generate(0)
    p = m.source.producer
    put, landed, resume = p.buffer.put, threading.Event(), threading.Event()

    def put_then_pause(group):
        ok = put(group)
        if not landed.is_set():
            landed.set()
            resume.wait(2.0)  # the snapshot below waits for the worker (the fix); before it, it did not
        return ok

    p.buffer.put = put_then_pause
    assert landed.wait(120)
    state = m.state_dict()
    resume.set()
    pending = state["async_requeue"]
    assert len(pending) == len(set(pending)), pending


def test_a_snapshot_while_the_trainer_requeues_a_stale_group_does_not_deadlock(tmp_path, managers):
    """``get`` re-queues a stale group's prompt while it holds the buffer; a snapshot at that moment
    (a checkpoint) holds the worker's lock and reads the buffer: before the fix the two took the two
    locks in opposite orders and both threads hung."""
    m = _manager(tmp_path, "--async-unused-samples-handler", "retry")
    managers.append(m)
    m.generate(0)
    p = m.source.producer
    deadline = time.monotonic() + 120
    while len(p.buffer) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    requeue, requeuing, go = p.buffer.requeue, threading.Event(), threading.Event()

    def slow_requeue(rec):
        requeuing.set()
        go.wait(1.0)  # the snapshot starts meanwhile
        requeue(rec)

    p.buffer.requeue = slow_requeue
    with p.gate.exclusive():
        p.gate.version = 100  # every group buffered so far is stale, the next ones are fresh
    states = []
    getter = threading.Thread(target=lambda: p.buffer.get(100, timeout=0.5), daemon=True)
    getter.start()
    assert requeuing.wait(30)
    snap = threading.Thread(target=lambda: states.append(m.state_dict()), daemon=True)
    snap.start()
    time.sleep(0.3)  # the snapshot is under way (before the fix: holding the worker's lock)
    go.set()
    getter.join(20)
    snap.join(20)
    assert not getter.is_alive() and not snap.is_alive(), "the trainer's get and the snapshot deadlocked"
    assert states and states[0]["async_requeue"]


# -- issue 44 item 3: a token's version is the version of the weights that drew it -------------------


def test_the_first_take_after_a_resumed_start_labels_tokens_with_the_weights_the_engines_hold(tmp_path, managers):
    """A run resumed at rollout 3 with rollout 3 taken ahead (pending): the start-up sync loads the
    trainer's weights, version 3; rollout 3 is trained without publishing (--update-weights-interval
    2), so take(4) loads nothing and every token of it was drawn by version 3: staleness 1 (before
    the fix the worker started at version 4 and reported 0)."""
    from rl_plugin.weight_sync import SyncRequest, WeightPublisher

    m = _manager(tmp_path, "--update-weights-interval", "2", "--max-weight-staleness", "2")
    managers.append(m)
    pub = WeightPublisher("shared_memory")
    try:
        weights = {k: v.clone() for k, v in m.fleet.engine.weights().items()}  # the trainer's: version 3
        handle = pub.publish(weights, SyncRequest(buffer_bytes=1 << 20, transport="shared_memory"))
        m.update_weights(handle, 3)  # the run's start-up sync (``RolloutPieces.sync_weights``)
        data = m.generate(4)
    finally:
        pub.close()
    assert data.stats["async/staleness_max"] == 1.0 and data.stats["async/staleness_mean"] == 1.0


# -- issue 44 item 20: a fully-async checkpoint resumed without --fully-async -----------------------


def test_a_fully_async_checkpoint_resumed_without_fully_async_trains_its_requeued_prompts_first(tmp_path):
    """The checkpoint's ``async_requeue`` (prompts taken and not trained on) are the first prompts of
    the synchronous loop's next rollout, then the dataset continues at the saved position (before
    the fix they were skipped: the rollout started at the position)."""
    args = parse_train_flags(
        ["--n-samples-per-prompt", "2", "--rollout-batch-size", "4", "--rollout-max-response-len", "8"]
        + ["--output-dir", str(tmp_path / "out")]
    )
    prepare_embedded(args)
    m = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)
    records = m.generation.prompts.dataset.records
    m.load_state_dict({"train_dataset": {"epoch": 0, "offset": 8}, "async_requeue": [5, 2]})
    data = m.generate(0)
    assert [e["prompt"] for e in data.examples] == [records[5].prompt] * 2  # the first group's two samples
    assert data.dataset_state == {"train_dataset": {"epoch": 0, "offset": 10}}  # two prompts from the dataset
