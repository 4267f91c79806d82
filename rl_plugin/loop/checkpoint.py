"""Checkpoint bookkeeping of the loop (the backend writes model/optimizer/RNG inside a step dir).

Layout, as Megatron-LM: ``<save>/iter_0000012/`` (the backend's files) and
``<save>/latest_checkpointed_iteration.txt`` naming the last COMPLETE one; the tracker is
written (atomically) only after every rank returned from ``save_checkpoint``, so a crash mid-save
leaves the previous checkpoint as the resume point.

Beside the backend's files the loop writes ``loop_state.json`` into each step dir (before the
tracker): the backend that wrote it and where the loop stood (next rollout, samples seen). The
trainer reads it before Ray starts to refuse a checkpoint of the other backend, or a finished run
with nothing left to train, in its first second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional

from rl_plugin.arguments.paths import CHECKPOINT_TRACKER as TRACKER
from rl_plugin.arguments.paths import STEP_DIR, latest_checkpoint_step

LOOP_STATE = "loop_state.json"


def step_dir(root, step: int) -> str:
    return str(Path(root) / f"iter_{step:07d}")


def write_tracker(root, step: int) -> None:
    path = Path(root) / TRACKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, path)


def latest_step(root) -> Optional[int]:
    """The last complete checkpoint's step under ``root``, or None when there is none yet."""
    return latest_checkpoint_step(root)


def write_loop_state(root, step: int, state: Dict[str, Any]) -> None:
    path = Path(step_dir(root, step)) / LOOP_STATE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, path)


def read_loop_state(root, step: int) -> Optional[Dict[str, Any]]:
    path = Path(step_dir(root, step)) / LOOP_STATE
    return json.loads(path.read_text()) if path.is_file() else None


def written_by(root, step: int) -> Optional[str]:
    """Which backend wrote the checkpoint at ``step``: ``loop_state.json`` says so; older
    checkpoints are recognised by their files (Megatron: dist_checkpointing's ``common.pt``, or
    the older ``latest`` + ``iter_*/rank_*.pt``; FSDP: ``meta.pt`` + DCP ``.metadata``; Megatron's
    ``torch_dist`` has a ``.metadata`` too, so it is checked first). None when neither matches."""
    state = read_loop_state(root, step)
    if state and state.get("train_backend"):
        return state["train_backend"]
    d = Path(step_dir(root, step))
    if (d / "common.pt").is_file() or (d / "latest").is_file() or any(d.glob("iter_*/rank_*.pt")):
        return "megatron"
    if (d / "meta.pt").is_file() or (d / ".metadata").is_file():
        return "fsdp"
    return None


def move_checkpoints_aside(root) -> Optional[Path]:
    """``--overwrite-save``: move the tracker and every ``iter_*`` directory of ``root`` into
    ``root/overwritten_<N>/`` (a rename, nothing is copied or deleted); returns that directory."""
    root = Path(root)
    entries = [p for p in root.iterdir() if p.name == TRACKER or (p.is_dir() and STEP_DIR.match(p.name))] if root.is_dir() else []
    if not entries:
        return None
    n = 1
    while (root / f"overwritten_{n}").exists():
        n += 1
    dest = root / f"overwritten_{n}"
    dest.mkdir()
    for p in entries:
        p.rename(dest / p.name)
    return dest
