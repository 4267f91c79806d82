"""The checkpoint layout without a backend: the tracker, the staged save and its commit,
``--load`` resolution, ``--ckpt-step`` and ``--save-retain``."""

import pytest

from rl_plugin.checkpoint.commit import begin_save, commit_save, retain, write_tracker
from rl_plugin.checkpoint.layout import complete_steps, latest_step, read_loop_state, resolve, resume_step, step_dir
from rl_plugin.errors import RLArgumentError


def test_checkpoint_tracker(tmp_path):
    assert latest_step(tmp_path) is None
    write_tracker(tmp_path, 12)
    assert latest_step(tmp_path) == 12 and step_dir(tmp_path, 12).endswith("iter_0000012")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ValueError, match="holds 'release', not a step number"):
        latest_step(tmp_path)


def test_save_stages_then_renames_then_moves_the_tracker(tmp_path):
    """The loop's layout without a backend: files go into iter_*.partial, the commit adds
    loop_state.json, renames the directory and writes the tracker; a save of the same step
    again replaces the directory; --load resolves the root or a step dir, never a .partial."""
    staging = begin_save(tmp_path, 3)
    assert staging.name == "iter_0000003.partial" and list(staging.iterdir()) == []
    (staging / "shard.bin").write_bytes(b"a")
    assert latest_step(tmp_path) is None  # nothing is a resume point before the commit
    final = commit_save(tmp_path, 3, {"step": 3, "train_backend": "fsdp"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert sorted(p.name for p in final.iterdir()) == ["loop_state.json", "shard.bin"]
    assert latest_step(tmp_path) == 3 and read_loop_state(tmp_path, 3) == {"step": 3, "train_backend": "fsdp"}
    begin_save(tmp_path, 3).joinpath("shard.bin").write_bytes(b"b")
    commit_save(tmp_path, 3)
    assert (final / "shard.bin").read_bytes() == b"b" and not (final / "loop_state.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert resolve(tmp_path) == final and resolve(final) == final
    begin_save(tmp_path, 4)
    with pytest.raises(FileNotFoundError, match=r"unfinished save .* Fix: --load its parent directory"):
        resolve(tmp_path / "iter_0000004.partial")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint root"):
        resolve(tmp_path / "nowhere")


def test_ckpt_step_names_the_steps_the_directory_holds(tmp_path):
    """``--ckpt-step`` of a step without a complete checkpoint is refused, listing those it has;
    without ``--ckpt-step`` the tracker's step, with it the step asked for."""
    for step, rollouts in ((4, 4), (8, 8), (12, 12)):
        begin_save(tmp_path, step)
        commit_save(tmp_path, step, {"next_rollout": rollouts})
    (tmp_path / "iter_0000016.partial").mkdir()  # an unfinished save is not a step it holds
    assert complete_steps(tmp_path) == [4, 8, 12]
    assert resume_step(tmp_path) == 12 and resume_step(tmp_path, 8) == 8
    with pytest.raises(RLArgumentError, match=r"--ckpt-step 16: there is no complete checkpoint .* 4, 8, 12"):
        resume_step(tmp_path, 16)
    assert retain(tmp_path, keep_last=1, keep_every=8) == [4] and complete_steps(tmp_path) == [8, 12]
