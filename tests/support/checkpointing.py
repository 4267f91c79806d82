"""Checkpoints of a backend in a test's process group, in the loop's layout.

The loop saves from its driver: ``begin_save`` -> every rank's ``save_checkpoint`` into the
staging directory -> ``commit_save`` (``rl_plugin.checkpoint.commit``), which checks every rank's
reported files are there. A test's gloo world has no driver, so rank 0 takes its part between
barriers (the file lists gathered to it); the files and the order are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch.distributed as dist

from rl_plugin.checkpoint import commit, layout


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    backend, root, step: int, extra: Optional[Dict[str, Any]] = None, loop_state: Optional[Dict[str, Any]] = None
) -> Path:
    """Collective: ``root/iter_{step:07d}`` written as the loop writes it; returns that directory."""
    if _rank() == 0:
        commit.begin_save(root, step)
    _barrier()
    files = backend.save_checkpoint(str(layout.partial_dir(root, step)), step=step, extra=extra)
    written = [None] * dist.get_world_size() if dist.is_initialized() else [files]
    if dist.is_initialized():
        dist.all_gather_object(written, files)
    if _rank() == 0:
        final = commit.commit_save(root, step, loop_state, written)
        on_disk = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()} - {layout.LOOP_STATE}
        reported = set().union(*map(set, written))
        assert on_disk == reported, (
            f"files on disk but not reported: {on_disk - reported}; reported, not on disk: {reported - on_disk}"
        )
    _barrier()
    return Path(layout.step_dir(root, step))


def load(backend, path) -> Dict[str, Any]:
    """Collective: ``--load path`` (a ``--save`` root or one ``iter_*`` directory)."""
    return backend.load_checkpoint(str(layout.resolve(path)))
