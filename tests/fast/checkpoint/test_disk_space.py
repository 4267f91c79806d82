"""The disk space of a checkpoint (``rl_plugin.checkpoint.disk_space``): parameters counted from the
safetensors headers, 12 bytes each, the bytes of a directory, and the disk-full line after a save."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import save_file

from rl_plugin.checkpoint.disk_space import (
    BYTES_PER_PARAMETER,
    checkpoint_bytes_estimate,
    directory_bytes,
    disk_full_message,
    parameter_count,
)


def test_parameters_from_every_safetensors_header(tmp_path):
    assert parameter_count(str(tmp_path)) is None and checkpoint_bytes_estimate(str(tmp_path)) is None
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, tmp_path / "model-1.safetensors")
    save_file({"c": torch.zeros(2, 3, 7)}, tmp_path / "model-2.safetensors", metadata={"format": "pt"})
    (tmp_path / "notes.bin").write_bytes(b"\0" * 1000)  # not a safetensors file: not counted
    assert parameter_count(str(tmp_path)) == 12 + 5 + 42
    assert checkpoint_bytes_estimate(str(tmp_path)) == BYTES_PER_PARAMETER * 59 == 708


def test_directory_bytes_sums_files_below(tmp_path):
    assert directory_bytes(tmp_path / "none") is None
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "x").write_bytes(b"1" * 10)
    (tmp_path / "d" / "e" / "y").write_bytes(b"1" * 32)
    assert directory_bytes(tmp_path / "d") == 42


def test_disk_full_message_from_the_error_or_the_free_space(tmp_path):
    free_mib = shutil.disk_usage(tmp_path).free / 2**20
    assert disk_full_message(str(tmp_path), "PermissionError: denied", 1024) is None
    said = disk_full_message(str(tmp_path), "OSError: [Errno 28] No space left on device", None)
    assert said.startswith(f"no space left on the device of --save {tmp_path} (") and "MiB free)" in said
    reported_mib = float(said.split("(")[1].split(" MiB")[0])
    assert abs(reported_mib - free_mib) <= 0.05 * free_mib  # the free space (others write meanwhile)
    short = disk_full_message(str(tmp_path), "unrelated", 2**62)  # less free than the last checkpoint took
    assert short is not None and short.endswith(f"; the last checkpoint took {2**62 / 2**20:.1f} MiB)")
