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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from rl_plugin.checkpoint.layout import step_dir
from rl_plugin.errors import LoopError
from rl_plugin.rollout.sample import RolloutData

PENDING_ROLLOUT = "pending_rollout.pt"


@dataclass(frozen=True)
class PendingRollout:
    """A rollout generated before the steps of the one before it were trained on (overlapped
    training): a schedule holds it between rollouts, a checkpoint keeps it (``pending_rollout.pt``)
    so a resumed run trains on it as the uninterrupted run would."""

    rollout_id: int
    data: RolloutData
    staleness: int  # how many weight versions behind the trainer's the weights that sampled it are

    def data_for(self, k: int) -> RolloutData:
        """The rollout, checked to be rollout ``k`` (the one the loop is at)."""
        if self.rollout_id != k:
            raise LoopError(
                f"internal: the rollout generated ahead is rollout {self.rollout_id}, the loop is at rollout {k}"
            )
        return self.data


def write_pending_rollout(directory, pending: PendingRollout) -> None:
    """Into ``directory``: the checkpoint's staging directory (``commit.begin_save``)."""
    path = Path(directory) / PENDING_ROLLOUT
    tmp = path.with_suffix(".tmp")
    payload = {
        "rollout_id": int(pending.rollout_id),
        "staleness": int(pending.staleness),
        "data": {f.name: getattr(pending.data, f.name) for f in fields(pending.data)},
    }
    torch.save(payload, tmp)
    os.replace(tmp, path)


def read_pending_rollout(root, step: int) -> Optional[PendingRollout]:
    """The rollout generated ahead that the checkpoint at ``step`` holds, or None when it holds none
    (a synchronous run's checkpoint, or the last rollout's)."""
    path = Path(step_dir(root, step)) / PENDING_ROLLOUT
    if not path.is_file():
        return None
    payload = torch.load(path, weights_only=True)
    return PendingRollout(int(payload["rollout_id"]), RolloutData(**payload["data"]), int(payload["staleness"]))
