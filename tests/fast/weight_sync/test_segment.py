"""The shared-memory segment (``rl_plugin.weight_sync.segment``): the layout's offsets, a create /
open round trip, the checks a reader makes, and the sweep of segments whose creator died. The
segments are made in ``tmp_path`` (``create``'s ``directory``), not in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rl_plugin.weight_sync.segment import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    SEGMENT_PREFIX,
    SharedWeightSegment,
    WeightLayout,
    segment_pid,
    sweep_stale,
)

TENSORS = {
    "a": torch.arange(3, dtype=torch.float32),  # 12 bytes
    "b": torch.ones(2, 5, dtype=torch.bfloat16),  # 20 bytes
    "c": torch.zeros(70, dtype=torch.int8),  # 70 bytes
}


def test_layout_offsets_are_aligned_in_export_order():
    layout = WeightLayout.of(TENSORS)
    assert [(s.name, s.dtype, s.shape, s.offset, s.nbytes) for s in layout.slots] == [
        ("a", "float32", (3,), HEADER_BYTES, 12),
        ("b", "bfloat16", (2, 5), HEADER_BYTES + ALIGN, 20),
        ("c", "int8", (70,), HEADER_BYTES + 2 * ALIGN, 70),
    ]
    assert layout.total_bytes == HEADER_BYTES + 2 * ALIGN + 128  # 70 bytes round up to two 64-byte lines
    assert layout.names == ["a", "b", "c"]


def test_fits_and_digest_tell_layouts_apart():
    layout = WeightLayout.of(TENSORS)
    assert layout.fits({k: v.clone() for k, v in TENSORS.items()})
    assert not layout.fits({"b": TENSORS["b"], "a": TENSORS["a"], "c": TENSORS["c"]})  # order
    assert not layout.fits({**TENSORS, "a": TENSORS["a"].double()})  # dtype
    assert not layout.fits({**TENSORS, "c": torch.zeros(7, 10, dtype=torch.int8)})  # shape
    assert not layout.fits({"a": TENSORS["a"]})
    other = WeightLayout.of({**TENSORS, "c": torch.zeros(71, dtype=torch.int8)})
    assert layout.digest() == WeightLayout.of(TENSORS).digest() and 0 <= layout.digest() < 2**63
    assert other.digest() != layout.digest()


def test_create_open_round_trip_and_version_check(tmp_path):
    layout = WeightLayout.of(TENSORS)
    seg = SharedWeightSegment.create(layout, directory=tmp_path)
    assert seg.path.name == f"{SEGMENT_PREFIX}.{os.getpid()}.0" and seg.path.stat().st_size == layout.total_bytes
    assert [int(x) for x in seg.header[:3]] == [MAGIC, 0, layout.digest()]
    seg.begin_write()
    for name, t in TENSORS.items():
        seg.views[name].copy_(t + 1)
    seg.end_write(5)
    reader = SharedWeightSegment.open(str(seg.path), layout)
    reader.check_version(5)
    for name, t in TENSORS.items():
        assert torch.equal(reader.views[name], t + 1)
    seg.begin_write()  # a write in progress: the reader refuses, naming both versions
    with pytest.raises(RuntimeError, match=r"holds the weights of sync 0 \(0: being written\), this load needs sync 5"):
        reader.check_version(5)
    second = SharedWeightSegment.create(layout, directory=tmp_path)
    assert second.path.name.endswith(f".{os.getpid()}.1")
    seg.close()
    assert not seg.path.exists() and second.path.exists()
    second.close()


def test_open_refuses_a_missing_resized_or_foreign_segment(tmp_path):
    layout = WeightLayout.of(TENSORS)
    with pytest.raises(FileNotFoundError, match=r"segment .*missing.*--update-weight-transport object_store"):
        SharedWeightSegment.open(str(tmp_path / "nope"), layout)
    seg = SharedWeightSegment.create(layout, directory=tmp_path)
    small = WeightLayout.of({"a": TENSORS["a"]})
    with pytest.raises(RuntimeError, match=rf"holds {layout.total_bytes} bytes, the layout needs {small.total_bytes}"):
        SharedWeightSegment.open(str(seg.path), small)
    same_size = WeightLayout.of({"x": TENSORS["a"], "b": TENSORS["b"], "c": TENSORS["c"]})  # another name
    assert same_size.total_bytes == layout.total_bytes
    with pytest.raises(RuntimeError, match="is not the trainer's weight segment for this layout"):
        SharedWeightSegment.open(str(seg.path), same_size)
    seg.close()


def test_segment_pid_and_sweep_of_dead_creators(tmp_path):
    assert segment_pid(tmp_path / f"{SEGMENT_PREFIX}.123.4") == 123
    assert segment_pid(tmp_path / f"{SEGMENT_PREFIX}.x.4") is None and segment_pid(tmp_path / "other.1.2") is None
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited
    stale = tmp_path / f"{SEGMENT_PREFIX}.{dead_pid}.0"
    mine = tmp_path / f"{SEGMENT_PREFIX}.{os.getpid()}.0"
    alive = tmp_path / f"{SEGMENT_PREFIX}.1.0"  # pid 1 is running
    for p in (stale, mine, alive):
        p.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [stale]
    assert mine.exists() and alive.exists()
    assert sweep_stale(tmp_path, dead_pids=[1]) == [alive]  # the reaper names the pids it killed
    assert mine.exists()
