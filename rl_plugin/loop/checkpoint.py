"""Checkpoint bookkeeping of the loop (the backend writes model/optimizer/RNG inside a step dir).

Layout, as Megatron-LM: ``<save>/iter_0000012/`` (the backend's files) and
``<save>/latest_checkpointed_iteration.txt`` naming the last COMPLETE one; the tracker is
written (atomically) only after every rank returned from ``save_checkpoint``, so a crash mid-save
leaves the previous checkpoint as the resume point.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"


def step_dir(root, step: int) -> str:
    return str(Path(root) / f"iter_{step:07d}")


def write_tracker(root, step: int) -> None:
    path = Path(root) / TRACKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, path)


def latest_step(root) -> Optional[int]:
    """The last complete checkpoint's step under ``root``, or None when there is none yet."""
    path = Path(root) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--load {root}: {TRACKER} holds {text!r}, not a step number") from None
