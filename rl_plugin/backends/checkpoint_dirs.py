"""Checkpoint directories shared by both backends: where a step goes, and how it appears atomically.

Layout of ``--save DIR`` (Megatron-LM's names, so tooling that reads them keeps working)::

    DIR/latest_checkpointed_iteration.txt   the last COMPLETE step; written last, atomically
    DIR/iter_0000012/                        one complete checkpoint (the backend's files)
    DIR/iter_0000012.partial/                a save in progress (never read by --load)

Atomic save: every rank writes into ``iter_*.partial``; once all of them returned, rank 0 renames
it to ``iter_*`` (``os.replace`` of a directory is atomic on POSIX file systems) and only then is
the tracker moved to the new step. A process killed at any point therefore leaves either the
previous tracker (pointing at a complete directory) or the new one; a ``.partial`` directory is
removed by the next save of that step and refused by ``resolve``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Tuple

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
PARTIAL = ".partial"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def iter_dir(root, step: int) -> Path:
    return Path(root) / f"iter_{int(step):07d}"


def target(path, step: int) -> Tuple[Path, bool]:
    """``(step_dir, write_tracker)``: ``path`` is either a ``--save`` root (the step goes into
    ``path/iter_*`` and the tracker is written) or already that step's ``iter_*`` directory (the
    loop passes it so; the loop writes its own tracker once every rank returned)."""
    p = Path(path)
    if p.name == iter_dir(p, step).name:
        return p, False
    return iter_dir(p, step), True


def begin(final: Path) -> Path:
    """Collective: a fresh, empty staging directory for ``final``; returns it."""
    staging = final.with_name(final.name + PARTIAL)
    if rank() == 0:
        if staging.exists():  # left by a save that was killed: never resumed from, safe to drop
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier()
    return staging


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, final: Path) -> Path:
    """Collective: once every rank has written into ``staging``, rank 0 renames it to ``final``
    (replacing an older ``final`` of the same step, e.g. one written after the tracker's step by
    a run that was killed before moving the tracker)."""
    barrier()
    if rank() == 0:
        old = final.with_name(final.name + ".replaced")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(final.parent)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return final


def write_tracker(root, step: int) -> None:
    """Point ``root``'s tracker at ``step`` (atomic rename of a fully written file)."""
    path = Path(root) / TRACKER
    tmp = path.with_name(TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{int(step)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve(path, marker: str) -> Path:
    """The step directory ``--load path`` means: a ``--save`` root (its tracker names the step)
    or an ``iter_*`` directory holding ``marker`` (the file a backend writes last)."""
    p = Path(path)
    if p.name.endswith(PARTIAL):
        raise FileNotFoundError(
            f"--load {path}: this is an unfinished save (killed while writing); it is never a resume point. "
            f"Fix: --load its parent directory {p.parent} (its {TRACKER} names the last complete step)"
        )
    if (p / TRACKER).exists():
        text = (p / TRACKER).read_text().strip()
        try:
            step = int(text)
        except ValueError:
            raise ValueError(f"--load {path}: {TRACKER} holds {text!r}, not a step number") from None
        d = iter_dir(p, step)
        if not d.is_dir():
            raise FileNotFoundError(f"--load {path}: {TRACKER} names step {step} but {d} does not exist")
        return d
    if (p / marker).exists():
        return p
    raise FileNotFoundError(
        f"--load {path}: neither a checkpoint root with {TRACKER} nor an iter_* checkpoint directory "
        f"(no {marker} there)"
    )
