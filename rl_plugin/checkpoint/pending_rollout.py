"""The rollout generated ahead, kept in a checkpoint (``--max-weight-staleness 1``).

Under overlapped training, a checkpoint after rollout k's steps is taken once rollout k+1 has
been generated (by the weights before step k): that rollout is part of the loop's state, since
regenerating it on resume would sample it with the newer weights and the resumed run would
diverge from the uninterrupted one. The driver writes it as ``pending_rollout.pt`` into the
checkpoint's staging directory beside ``loop_state.json`` (``commit.begin_save`` / ``commit_save``:
the directory is renamed into place, then the tracker names the step), so a complete checkpoint
always has it; on ``--load`` the loop trains on it instead of generating rollout k+1 again.

The file holds the ``RolloutData`` fields (tensors saved bitwise), the rollout's id and the lag
of the weights that sampled it; it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Optional, Tuple

import torch

from rl_plugin.checkpoint.layout import step_dir
from rl_plugin.rollout.rollout_data import RolloutData

PENDING_ROLLOUT = "pending_rollout.pt"


def write_pending_rollout(directory, rollout_id: int, data: RolloutData, staleness: int) -> None:
    """Into ``directory``: the checkpoint's staging directory (``commit.begin_save``)."""
    path = Path(directory) / PENDING_ROLLOUT
    tmp = path.with_suffix(".tmp")
    payload = {
        "rollout_id": int(rollout_id),
        "staleness": int(staleness),
        "data": {f.name: getattr(data, f.name) for f in fields(data)},
    }
    torch.save(payload, tmp)
    os.replace(tmp, path)


def read_pending_rollout(root, step: int) -> Optional[Tuple[int, RolloutData, int]]:
    """``(rollout_id, data, staleness)`` of the checkpoint at ``step``, or None when it holds none
    (a synchronous run's checkpoint, or the last rollout's)."""
    path = Path(step_dir(root, step)) / PENDING_ROLLOUT
    if not path.is_file():
        return None
    payload = torch.load(path, weights_only=True)
    return int(payload["rollout_id"]), RolloutData(**payload["data"]), int(payload["staleness"])
