"""The disk space of a checkpoint: what one will need, what the last one took, and whether a
failed save ran out of room.

``checkpoint_bytes_estimate`` = 12 bytes per parameter of ``--hf-checkpoint`` (fp32 weights and
AdamW's two fp32 moments; the backends' metadata and RNG files are small beside them; the tiny
embedded model's measure ~15 bytes per parameter, so it is a floor), counted from the
``*.safetensors`` headers alone. The loop's preflight (``rl_plugin.loop.disk_checks``) refuses a
``--save`` whose file system cannot hold that much.

``disk_full_message``: after a failed save, whether the device of ``--save`` ran out of space
(the error says so, or less than the last checkpoint, ``directory_bytes``, is free), as a line
naming the numbers.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Optional

BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq


def parameter_count(hf_checkpoint: str) -> Optional[int]:
    """Parameters of the ``*.safetensors`` files of ``hf_checkpoint``, from their headers alone
    (no tensor is read); None when the directory has none."""
    files = sorted(Path(hf_checkpoint).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for d in info["shape"]:
                    count *= d
                total += count
    return total


def checkpoint_bytes_estimate(hf_checkpoint: str) -> Optional[int]:
    n = parameter_count(hf_checkpoint)
    return None if n is None else BYTES_PER_PARAMETER * n


def disk_full_message(save_root: str, error: str, last_checkpoint_bytes: Optional[int]) -> Optional[str]:
    """A line naming the lack of space when ``error`` (a failed save's) came from it; else None."""
    free = shutil.disk_usage(save_root).free
    said = any(s in error for s in ("No space left", "ENOSPC", "unexpected pos", "Disk quota exceeded"))
    short = last_checkpoint_bytes is not None and free < last_checkpoint_bytes
    if not (said or short):
        return None
    need = f"; the last checkpoint took {last_checkpoint_bytes / 2**20:.1f} MiB" if last_checkpoint_bytes else ""
    return f"no space left on the device of --save {save_root} ({free / 2**20:.1f} MiB free{need})"


def directory_bytes(path) -> Optional[int]:
    """The bytes of the files under ``path`` (None when it does not exist)."""
    p = Path(path)
    if not p.is_dir():
        return None
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
