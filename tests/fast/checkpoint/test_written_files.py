"""``RecordingFileSystemWriter`` (``rl_plugin.checkpoint.written_files``) reports exactly the files a
torch.distributed.checkpoint save put on disk (one process, no group), and ``existing`` those of a
list that are files."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from rl_plugin.checkpoint.written_files import DCP_METADATA, RecordingFileSystemWriter, existing


def test_the_writer_records_every_file_of_the_save(tmp_path):
    state = {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    writer = RecordingFileSystemWriter(str(tmp_path))
    dcp.save(state, storage_writer=writer)
    on_disk = {p.name for p in tmp_path.iterdir() if p.is_file()}
    assert writer.written == on_disk and DCP_METADATA in on_disk and len(on_disk) >= 2
    back = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.load(back, checkpoint_id=str(tmp_path))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])  # the same bytes as DCP's


def test_existing_keeps_the_files_sorted(tmp_path):
    (tmp_path / "common.pt").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    assert existing(tmp_path, ["zz.pt", "common.pt", "sub", "missing"]) == ["common.pt"]
