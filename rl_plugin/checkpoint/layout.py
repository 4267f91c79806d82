"""The names of a ``--save`` directory and their readers (nothing here writes).

With Megatron-LM's names, so tooling that reads them keeps working::

    DIR/latest_checkpointed_iteration.txt   TRACKER: the last COMPLETE step; written last, atomically
    DIR/iter_0000012/                        step_dir(DIR, 12): one complete checkpoint
        <the backend's files>                  written by ``TrainBackend.save_checkpoint(dir)``
        loop_state.json                        LOOP_STATE: the backend that wrote it, where the loop stood
        pending_rollout.pt                     the rollout generated ahead (``pending_rollout``), if any
    DIR/iter_0000012.partial/                partial_dir(DIR, 12): a save in progress (never read by --load)

The writers of this layout are in ``commit`` (the atomic save, retention, ``--overwrite-save``).
The readers: ``latest_step`` (the tracker), ``complete_steps``, ``resume_step`` (``--load``
with ``--ckpt-step``), ``resolve`` (the step directory ``--load`` means), ``read_loop_state`` and
``written_by`` (which backend wrote a step, so the trainer refuses the other one before Ray starts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from rl_plugin.errors import RLArgumentError, fail

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name; written last, atomically
STEP_DIR = re.compile(r"iter_(\d{7})$")
PARTIAL = ".partial"  # suffix of a save being written (``commit.commit_save`` renames it away when complete)
LOOP_STATE = "loop_state.json"


def step_dir(root, step: int) -> str:
    """``root/iter_{step:07d}``: where the complete checkpoint of ``step`` lives."""
    return str(Path(root) / f"iter_{int(step):07d}")


def partial_dir(root, step: int) -> Path:
    """Where the checkpoint of ``step`` is written until it is complete."""
    return Path(step_dir(root, step) + PARTIAL)


def latest_step(root) -> Optional[int]:
    """The last complete checkpoint's step under a ``--save`` directory, or None when there is
    none yet; a tracker that holds no step number is an ``RLArgumentError`` naming the fix."""
    path = Path(root) / TRACKER
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise RLArgumentError(
            f"--load {root}: {TRACKER} holds {text!r}, not a step number. Fix: write the step of the last complete iter_* directory into it."
        ) from None


def read_loop_state(root, step: int) -> Optional[Dict[str, Any]]:
    path = Path(step_dir(root, step)) / LOOP_STATE
    return json.loads(path.read_text()) if path.is_file() else None


def complete_steps(root) -> List[int]:
    """The steps of the complete ``iter_*`` directories under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name))


def resume_step(root, ckpt_step: Optional[int] = None) -> Optional[int]:
    """The step ``--load root`` resumes: ``--ckpt-step`` when given (its directory must be a
    complete checkpoint), else the tracker's; None when ``root`` holds no checkpoint yet."""
    if ckpt_step is None:
        return latest_step(root)
    if not Path(step_dir(root, ckpt_step)).is_dir():
        have = complete_steps(root)
        fail(
            f"--load {root} --ckpt-step {ckpt_step}",
            f"there is no complete checkpoint of step {ckpt_step} ({step_dir(root, ckpt_step)})",
            f"pick one of the steps it holds: {', '.join(map(str, have)) or 'none'}",
        )
    return int(ckpt_step)


def resolve(path) -> Path:
    """The complete step directory ``--load path`` means: a ``--save`` root (its tracker names
    the step) or one ``iter_*`` directory. An unfinished ``.partial`` save is refused."""
    p = Path(path)
    if p.name.endswith(PARTIAL):
        raise FileNotFoundError(
            f"--load {path}: this is an unfinished save (killed while writing); it is never a resume point. "
            f"Fix: --load its parent directory {p.parent} (its {TRACKER} names the last complete step)"
        )
    step = latest_step(p)
    if step is not None:
        d = Path(step_dir(p, step))
        if not d.is_dir():
            raise FileNotFoundError(f"--load {path}: {TRACKER} names step {step} but {d} does not exist")
        return d
    if STEP_DIR.match(p.name) and p.is_dir():
        return p
    raise FileNotFoundError(
        f"--load {path}: neither a checkpoint root with {TRACKER} nor an iter_{{step:07d}} checkpoint directory"
    )


def written_by(root, step: int) -> Optional[str]:
    """Which backend wrote the checkpoint at ``step``: ``loop_state.json`` says so; checkpoints
    without one (written by a backend outside the loop) are recognised by their files (Megatron:
    dist_checkpointing's ``common.pt``, or the refused per-rank ``rank_*.pt`` format; FSDP:
    ``meta.pt`` + DCP ``.metadata``; Megatron's ``torch_dist`` has a ``.metadata`` too, so it is
    checked first). None when neither matches."""
    state = read_loop_state(root, step)
    if state and state.get("train_backend"):
        return state["train_backend"]
    d = Path(step_dir(root, step))
    if (
        (d / "common.pt").is_file()
        or (d / "latest").is_file()
        or any(d.glob("rank_*.pt"))
        or any(d.glob("iter_*/rank_*.pt"))
    ):
        return "megatron"
    if (d / "meta.pt").is_file() or (d / ".metadata").is_file():
        return "fsdp"
    return None
