"""Writing a checkpoint into the layout of ``layout``: the atomic save, retention, ``--overwrite-save``.

The loop owns the layout around the backends' files (a backend writes only its own files into the
directory it is given). A save is three steps, done by ONE process (the driver; in a test, rank 0
between barriers):

1. ``begin_save``: a fresh, empty ``iter_*.partial`` (one left by a killed save is removed);
2. every training rank writes its files into it (``save_checkpoint`` of the backend);
3. ``commit_save``: first every rank's files (the list its ``save_checkpoint`` returned) must
   be visible to the committing process under the staging directory (``missing_files``), else
   nothing is committed and the error names the rank, its node and the files: a ``--save`` on
   a node-local disk writes a checkpoint that looks complete and fails on load, so ``--save``
   must be a file system every node shares. Then ``loop_state.json`` into the staging directory,
   the staging directory renamed to ``iter_*`` (``os.replace`` of a directory is atomic on
   POSIX file systems), and only then the tracker moved to the new step.

A process killed at any point therefore leaves either the previous tracker (pointing at a
complete directory) or the new one: a crash mid-save leaves the previous checkpoint as the
resume point, and a ``.partial`` directory is refused by ``layout.resolve``; ``remove_partial``
drops the one a failed save left. ``retain`` (``--save-retain``) deletes older checkpoints only
once the new one is committed; ``move_checkpoints_aside`` (``--overwrite-save``) renames a
directory's checkpoints away, deleting nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from rl_plugin.checkpoint.layout import (
    LOOP_STATE,
    STEP_DIR,
    TRACKER,
    complete_steps,
    latest_step,
    partial_dir,
    read_loop_state,
    step_dir,
)
from rl_plugin.errors import LoopError


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its old content, never a part of it (fsync, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tracker(root, step: int) -> None:
    """Point ``root``'s tracker at ``step``."""
    _write_atomic(Path(root) / TRACKER, f"{int(step)}\n")


def write_loop_state(directory, state: Dict[str, Any]) -> None:
    """``loop_state.json`` into a step directory (``commit_save`` writes it into the staging one)."""
    _write_atomic(Path(directory) / LOOP_STATE, json.dumps(state, sort_keys=True))


def begin_save(root, step: int) -> Path:
    """Step 1 of a save: a fresh, empty ``iter_*.partial`` directory; returns it."""
    staging = partial_dir(root, step)
    if staging.exists():  # left by a save that was killed: never resumed from, safe to drop
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, final: Path) -> None:
    """Rename the complete ``staging`` directory to ``final``, replacing an older ``final`` of
    the same step (one written after the tracker's step by a run killed before moving it)."""
    old = final.with_name(final.name + ".replaced")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


# A shared file system may show another node's new files a moment late (NFS attribute caches):
# the check looks again for this long before it refuses.
VISIBILITY_GRACE_S = 5.0


def missing_files(staging, written: Sequence[Sequence[str]]) -> Dict[int, List[str]]:
    """``{rank: [files]}``: the files rank r reported (``written[r]``, relative paths) that are
    not files under ``staging`` as this process sees it; empty when every one is there."""
    staging = Path(staging)
    missing = {r: [f for f in files if not (staging / f).is_file()] for r, files in enumerate(written)}
    return {r: files for r, files in missing.items() if files}


class IncompleteCheckpointError(LoopError):
    """A rank's checkpoint files are not visible where the checkpoint is committed."""


def check_all_written(
    staging,
    written: Sequence[Sequence[str]],
    nodes: Optional[Sequence[str]] = None,
    grace_s: Optional[float] = None,
) -> None:
    """Raise ``IncompleteCheckpointError`` unless every rank's files (``written[r]``) are under
    ``staging``, looked for again for up to ``grace_s`` seconds; names the first rank missing
    files, its node (``nodes[r]``), up to five of the files and how many ranks miss some."""
    deadline = time.monotonic() + (VISIBILITY_GRACE_S if grace_s is None else grace_s)
    missing = missing_files(staging, written)
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        missing = missing_files(staging, written)
    if not missing:
        return
    rank = min(missing)
    files = missing[rank]
    node = f" on node {nodes[rank]}" if nodes and rank < len(nodes) else ""
    others = f"; {len(missing) - 1} other rank(s) miss files too: {sorted(missing)[1:]}" if len(missing) > 1 else ""
    raise IncompleteCheckpointError(
        f"checkpoint not committed: training rank {rank}{node} wrote {len(files)} file(s) that this process "
        f"(the driver, on {os.uname().nodename}) cannot see under {staging}: {files[:5]}"
        f"{' ...' if len(files) > 5 else ''}{others}. --save must be a file system shared by every training "
        "node and the driver (a node-local disk makes a checkpoint that fails on load). Fix: point --save at a "
        "shared file system (NFS, Lustre, a mounted bucket); the previous complete checkpoint stays the resume point"
    )


def commit_save(
    root,
    step: int,
    loop_state: Optional[Dict[str, Any]] = None,
    written: Optional[Sequence[Sequence[str]]] = None,
    nodes: Optional[Sequence[str]] = None,
) -> Path:
    """Step 3 of a save, once every rank has written its files into ``partial_dir(root, step)``:
    the check that ``written`` (rank r's files, relative paths; None: not checked) are all there
    (``check_all_written``, naming the rank and its node ``nodes[r]``), then ``loop_state.json``,
    the rename to ``iter_*``, then the tracker (last). Returns the step dir."""
    staging, final = partial_dir(root, step), Path(step_dir(root, step))
    if written is not None:
        check_all_written(staging, written, nodes)
    if loop_state is not None:
        write_loop_state(staging, loop_state)
    publish(staging, final)
    write_tracker(root, step)
    return final


def move_checkpoints_aside(root) -> Optional[Path]:
    """``--overwrite-save``: move the tracker and every ``iter_*`` directory of ``root`` into
    ``root/overwritten_<N>/`` (a rename, nothing is copied or deleted); returns that directory."""
    root = Path(root)
    entries = (
        [p for p in root.iterdir() if p.name == TRACKER or (p.is_dir() and STEP_DIR.match(p.name))]
        if root.is_dir()
        else []
    )
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


def retain(root, keep_last: Optional[int], keep_every: Optional[int] = None) -> List[int]:
    """``--save-retain``: delete the complete checkpoints of ``root`` older than its newest
    ``keep_last`` (never the tracker's), except those written after a multiple of ``keep_every``
    rollouts (their ``loop_state.json``'s ``next_rollout``). Returns the deleted steps."""
    if keep_last is None:
        return []
    steps = complete_steps(root)
    newest = latest_step(root)
    deleted = []
    for step in steps[:-keep_last] if keep_last < len(steps) else []:
        if step == newest:
            continue
        rollouts = (read_loop_state(root, step) or {}).get("next_rollout")
        if keep_every and rollouts is not None and rollouts % keep_every == 0:
            continue
        shutil.rmtree(step_dir(root, step))
        deleted.append(step)
    return deleted


def remove_partial(path) -> None:
    """Remove an unfinished save (never a resume point) so it does not hold the space it took."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # pragma: no cover - a file system that refuses even removal
        print(f"could not remove the unfinished save {path}; delete it by hand", flush=True)
