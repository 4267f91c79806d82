"""The files one rank wrote into a checkpoint directory, as paths relative to it.

A backend's ``save_checkpoint`` returns them so that the loop can check, before it commits a
checkpoint, that the process committing it sees every rank's files (``rl_plugin.checkpoint.commit
.commit_save``): a ``--save`` on a node-local disk would otherwise make a checkpoint that looks
complete and fails on load.

``RecordingFileSystemWriter`` is torch.distributed.checkpoint's ``FileSystemWriter`` (same
arguments, same bytes on disk) that remembers the shard files this rank wrote (``write_data``:
its ``WriteResult`` paths, plus the files named with this rank's storage prefix, ``__{rank}_``,
which include a file left empty when deduplication gave the rank nothing to write) and, on the
coordinating rank, the ``.metadata`` file (``finish``).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Set

from torch.distributed.checkpoint import FileSystemWriter

DCP_METADATA = ".metadata"


class RecordingFileSystemWriter(FileSystemWriter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written: Set[str] = set()

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        self.written.update(str(r.storage_data.relative_path) for r in fut.wait())
        prefix = plan.storage_data.prefix
        self.written.update(p.name for p in Path(self.path).glob(f"{prefix}*") if p.is_file())
        return fut

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.written.add(DCP_METADATA)


def existing(directory, names) -> List[str]:
    """Those of ``names`` (relative to ``directory``) that are files there, sorted: what a rank
    reports of the files it may have written (e.g. rank 0's ``common.pt``)."""
    return sorted(n for n in names if (Path(directory) / n).is_file())
