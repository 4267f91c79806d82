"""Checkpoints of a backend in a test's process group, in the loop's layout.

The loop saves from its driver: ``begin_save`` -> every rank's ``save_checkpoint`` into the
staging directory -> ``commit_save`` (``rl_plugin.loop.checkpoint``). A test's gloo world has no
driver, so rank 0 takes its part between barriers; the files and the order are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch.distributed as dist

from rl_plugin.loop import checkpoint


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
        checkpoint.begin_save(root, step)
    _barrier()
    backend.save_checkpoint(str(checkpoint.partial_dir(root, step)), step=step, extra=extra)
    _barrier()
    if _rank() == 0:
        checkpoint.commit_save(root, step, loop_state)
    _barrier()
    return Path(checkpoint.step_dir(root, step))


def load(backend, path) -> Dict[str, Any]:
    """Collective: ``--load path`` (a ``--save`` root or one ``iter_*`` directory)."""
    return backend.load_checkpoint(str(checkpoint.resolve(path)))
