"""``commit_save`` commits only when every rank's files are visible where it runs
(``rl_plugin.checkpoint.commit.check_all_written``): a node-local ``--save`` is refused, naming the
rank, its node and the files, and leaves the previous checkpoint the resume point. That each
backend reports exactly the files of its checkpoint is checked by ``tests/support/checkpointing.py``
on every test save (the FSDP and Megatron checkpoint tests)."""

from __future__ import annotations

import pytest

from rl_plugin.checkpoint import commit
from rl_plugin.checkpoint.commit import IncompleteCheckpointError, begin_save, commit_save, missing_files
from rl_plugin.checkpoint.layout import LOOP_STATE, latest_step


def _write(staging, *names):
    for n in names:
        (staging / n).parent.mkdir(parents=True, exist_ok=True)
        (staging / n).write_bytes(b"x")


def test_commit_with_every_rank_file_visible(tmp_path):
    staging = begin_save(tmp_path, 4)
    written = [[".metadata", "__0_0.distcp", "rng_rank0.pt"], ["__1_0.distcp", "rng_rank1.pt"]]
    _write(staging, *written[0], *written[1])
    assert missing_files(staging, written) == {}
    final = commit_save(tmp_path, 4, {"step": 4}, written, ["10.0.0.1", "10.0.0.2"])
    assert latest_step(tmp_path) == 4 and (final / "__1_0.distcp").is_file()


def test_node_local_save_is_refused_naming_rank_node_and_files(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "VISIBILITY_GRACE_S", 0.0)
    staging = begin_save(tmp_path, 2)
    _write(staging, "a.pt")
    commit_save(tmp_path, 2, {"step": 2}, [["a.pt"]])
    # step 4: rank 0 wrote on the driver's disk; ranks 1 and 2 wrote on their own nodes' disks
    staging = begin_save(tmp_path, 4)
    written = [["__0_0.distcp", ".metadata"], ["__1_0.distcp", "rng_rank1.pt"], ["sub/x.pt"]]
    _write(staging, *written[0])
    assert missing_files(staging, written) == {1: ["__1_0.distcp", "rng_rank1.pt"], 2: ["sub/x.pt"]}
    with pytest.raises(
        IncompleteCheckpointError,
        match=r"checkpoint not committed: training rank 1 on node 10\.0\.0\.2 wrote 2 file\(s\) .*cannot see under "
        r".*iter_0000004\.partial: \['__1_0\.distcp', 'rng_rank1\.pt'\]; 1 other rank\(s\) miss files too: \[2\]\. "
        r"--save must be a file system shared by every training node and the driver",
    ):
        commit_save(tmp_path, 4, {"step": 4}, written, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert latest_step(tmp_path) == 2  # nothing committed: no iter_0000004, no loop_state.json, tracker unmoved
    assert not (tmp_path / "iter_0000004").exists() and not (staging / LOOP_STATE).exists()


def test_files_that_show_up_late_are_waited_for(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(commit, "VISIBILITY_GRACE_S", 10.0)
    staging = begin_save(tmp_path, 1)
    late = threading.Timer(0.3, _write, (staging, "late.pt"))
    late.start()
    try:
        commit_save(tmp_path, 1, None, [["late.pt"]])
    finally:
        late.join()
    assert latest_step(tmp_path) == 1
