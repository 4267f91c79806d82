"""Disks before Ray starts, and a save that runs out of space.

``check_output_dirs`` (preflight): ``--output-dir`` and ``--save`` must be writable (a probe file is
created and removed; the directories are created as the run would), and ``--save``'s file system
must hold one checkpoint: ``checkpoint_bytes_estimate`` = 12 bytes per parameter of
``--hf-checkpoint`` (fp32 weights and AdamW's two fp32 moments; the backends' metadata and RNG
files are small beside them; the tiny embedded model's measure ~15 bytes per parameter, so the
check is a floor).

``disk_full_message``: after a failed save, whether the device of ``--save`` ran out of space
(the error says so, or less than one checkpoint is free), as a line naming the numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.loop.config import output_dir_of

BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq


def _writable(flag: str, path: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rl_plugin_probe_"):
            pass
    except OSError as exc:
        fail(
            f"{flag} {path}",
            f"the run cannot write there ({exc.strerror or exc})",
            f"point {flag} at a writable directory (checked before Ray starts, so nothing was trained yet)",
        )


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


def check_output_dirs(args) -> None:
    """Raise ``RLArgumentError`` naming the flag when a directory is unwritable or ``--save``
    cannot hold one checkpoint."""
    _writable("--output-dir", str(output_dir_of(args)))
    if args.save is None:
        return
    _writable("--save", args.save)
    need = checkpoint_bytes_estimate(args.hf_checkpoint) if args.hf_checkpoint else None
    free = shutil.disk_usage(args.save).free
    if need is not None and free < need:
        fail(
            f"--save {args.save}",
            f"its file system has {free / 2**20:.1f} MiB free, and one checkpoint of {args.hf_checkpoint} needs about "
            f"{need / 2**20:.1f} MiB (fp32 weights and AdamW's two moments, {BYTES_PER_PARAMETER} bytes per parameter)",
            "free space there or point --save at a larger disk",
        )


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


def remove_partial(path) -> None:
    """Remove an unfinished save (never a resume point) so it does not hold the space it took."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # pragma: no cover - a file system that refuses even removal
        print(f"could not remove the unfinished save {path}; delete it by hand", flush=True)
