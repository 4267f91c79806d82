"""Atomic saves: a training process SIGKILLed in the middle of a save leaves the previous
checkpoint as the resume point and nothing ``--load`` would read half-written.

A real FSDP training process (gloo, world 1) saves step 1, trains, and starts saving step 2; it
is killed with SIGKILL at one of two points of that save:

- ``shards``: every tensor shard of step 2 is on disk, the directory not yet renamed (the
  ``iter_0000002.partial`` staging directory is all there is);
- ``tracker``: ``iter_0000002`` is complete, the tracker not yet moved to it.

The saves go through the loop's layout (``rl_plugin.checkpoint.commit``; ``tests/support/checkpointing``
plays the driver's part in this one-process world).

Then: the tracker still names step 1, ``--load`` resolves to ``iter_0000001`` and restores it
(the weights saved at step 1, bitwise), a ``.partial`` directory is refused by name, and the next
save of step 2 replaces what the killed one left.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import checkpointing
from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch

KILL_POINTS = ("shards", "tracker")


def _saver(ckpt, root, kill_point, queue, port):
    """Save step 1, train, save step 2 and get killed inside that save (never returns)."""
    import torch.distributed as dist

    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.checkpoint import commit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt)))
    backend.train_step(step_batch(make_step(1, with_ref=False)), num_groups=3)
    checkpointing.save(backend, root, 1, extra={"rollout_id": 1})
    torch.save(backend.export_hf_state_dict(), Path(root) / "weights_step1.pt")
    backend.train_step(step_batch(make_step(2, with_ref=False)), num_groups=3)

    def wait_for_kill(*_args, **_kwargs):
        queue.put(os.getpid())
        signal.pause()  # the parent SIGKILLs us here, mid-save

    name = "publish" if kill_point == "shards" else "write_tracker"
    setattr(commit, name, wait_for_kill)
    checkpointing.save(backend, root, 2, extra={"rollout_id": 2})
    queue.put("save returned: the kill point was never reached")


def _resume(rank, world, ckpt, root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt)))
    meta = checkpointing.load(backend, root)
    weights = backend.export_hf_state_dict()
    try:
        checkpointing.load(backend, Path(root) / "iter_0000002.partial")
        partial_error = None
    except FileNotFoundError as e:
        partial_error = str(e)
    checkpointing.save(backend, root, 2, extra={"rollout_id": 2})  # the resumed run saves step 2 again
    return dict(meta=meta, weights=weights, partial_error=partial_error)


@pytest.fixture(scope="module", params=KILL_POINTS)
def killed(free_port, run_world, tiny_checkpoint, request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"atomic_{request.param}")
    ckpt = tiny_checkpoint()
    root = base / "save"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_saver, args=(ckpt, str(root), request.param, queue, free_port()))
    proc.start()
    msg = queue.get(timeout=300)
    assert msg == proc.pid, msg
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    left = sorted(p.name for p in root.iterdir())
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    resumed = run_world(_resume, 1, ckpt, str(root))[0]
    after = sorted(p.name for p in root.iterdir())
    return request.param, left, tracker, resumed, after, torch.load(root / "weights_step1.pt")


def test_killed_save_leaves_previous_checkpoint_as_resume_point(killed):
    kill_point, left, tracker, resumed, _, step1 = killed
    assert tracker == "1"
    staging = "iter_0000002.partial" if kill_point == "shards" else "iter_0000002"
    assert left == ["iter_0000001", staging, "latest_checkpointed_iteration.txt", "weights_step1.pt"]
    assert resumed["meta"]["step"] == 1 and resumed["meta"]["extra"] == {"rollout_id": 1}
    for name, w in step1.items():
        assert torch.equal(resumed["weights"][name], w), name


def test_partial_directory_is_refused_and_next_save_replaces_it(killed):
    kill_point, _, _, resumed, after, _ = killed
    if kill_point == "shards":
        assert "unfinished save" in resumed["partial_error"] and "--load its parent" in resumed["partial_error"]
    assert after == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt", "weights_step1.pt"]
