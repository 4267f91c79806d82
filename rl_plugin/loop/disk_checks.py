"""Disks before Ray starts (preflight): the run's output directories are writable and ``--save``
has room for one checkpoint.

``check_output_dirs``: ``--output-dir`` and ``--save`` must be writable (a probe file is created
and removed; the directories are created as the run would), and ``--save``'s file system must hold
one checkpoint (``rl_plugin.checkpoint.disk_space.checkpoint_bytes_estimate``: 12 bytes per
parameter of ``--hf-checkpoint``, a floor). A save that runs out of space later is named by
``disk_space.disk_full_message``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rl_plugin.checkpoint.disk_space import BYTES_PER_PARAMETER, checkpoint_bytes_estimate
from rl_plugin.errors import fail


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


def check_output_dirs(run) -> None:
    """Raise ``RLArgumentError`` naming the flag when a directory of the ``RunConfig`` ``run`` is
    unwritable or ``--save`` cannot hold one checkpoint."""
    _writable("--output-dir", str(run.output_dir))
    save, hf_checkpoint = run.checkpoint.save, run.train.model.hf_checkpoint
    if save is None:
        return
    _writable("--save", save)
    need = checkpoint_bytes_estimate(hf_checkpoint) if hf_checkpoint else None
    free = shutil.disk_usage(save).free
    if need is not None and free < need:
        fail(
            f"--save {save}",
            f"its file system has {free / 2**20:.1f} MiB free, and one checkpoint of {hf_checkpoint} needs about "
            f"{need / 2**20:.1f} MiB (fp32 weights and AdamW's two moments, {BYTES_PER_PARAMETER} bytes per parameter)",
            "free space there or point --save at a larger disk",
        )
