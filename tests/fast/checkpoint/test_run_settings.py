"""A resume with other settings than the checkpoint's (issue 38): the loop's own save records the
run settings in ``loop_state.json``, and preflight prints one note naming each that changed
(before: accepted without a word). The save is ``loop.resume.save_checkpoint``, with a train
group that writes no files (the settings are the driver's, not a rank's)."""

from __future__ import annotations

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.arguments.file_contents import check_resume_point
from rl_plugin.checkpoint.layout import read_loop_state
from rl_plugin.checkpoint.run_settings import settings_of
from rl_plugin.configs.run import RunConfig
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.preflight import note_changed_settings
from rl_plugin.loop.resume import Progress, save_checkpoint


class _NoFilesGroup:
    world_size = 1
    info = [{"ip": "127.0.0.1"}]

    def save(self, path, step, extra):
        return [[]]  # every rank wrote nothing (its files are not what this test reads)


def _args(tmp_path, *flags):
    """The run config of these flags, as the run builds it."""
    save = str(tmp_path / "ckpt")
    return RunConfig.from_args(parse_train_flags(["--save", save, "--load", save, "--num-rollout", "10", *flags]))


def test_resume_with_other_settings_names_each_change(tmp_path, capsys):
    first = _args(tmp_path)
    (tmp_path / "ckpt").mkdir()
    cfg = LoopConfig.of(first, run_settings=settings_of(first))  # as the run builds it
    save_checkpoint(cfg, _NoFilesGroup(), Progress(step=2), 1, {"epoch": 0, "offset": 32}, None)
    assert read_loop_state(str(tmp_path / "ckpt"), 2)["settings"]["--rollout-batch-size"] == 16

    same = _args(tmp_path)
    note_changed_settings(same, check_resume_point(same))
    assert capsys.readouterr().err == ""  # nothing changed: no note

    other = _args(tmp_path, "--rollout-batch-size", "8", "--loss-aggregation", "token_mean")
    note_changed_settings(other, check_resume_point(other))
    err = capsys.readouterr().err
    assert err.startswith(f"note: --load {tmp_path / 'ckpt'} (step 2) was trained with other settings"), err
    assert "--rollout-batch-size 16 -> 8; --loss-aggregation sample_mean -> token_mean." in err, err
    assert err.count("\n") == 1


def test_a_change_of_the_critics_settings_is_named(tmp_path, capsys):
    """PPO's discount and lambda change the advantages and the critic's targets (issue 47)."""
    first = _args(tmp_path, "--advantage-estimator", "ppo")
    (tmp_path / "ckpt").mkdir()
    save_checkpoint(
        LoopConfig.of(first, run_settings=settings_of(first)), _NoFilesGroup(), Progress(step=2), 1, {}, None
    )
    saved = read_loop_state(str(tmp_path / "ckpt"), 2)["settings"]
    assert (saved["--gamma"], saved["--lambd"], saved["--value-clip"], saved["--critic-lr"]) == (1.0, 1.0, 0.2, None)

    other = _args(tmp_path, "--advantage-estimator", "ppo", "--gamma", "0.99", "--critic-lr", "1e-5")
    note_changed_settings(other, check_resume_point(other))
    err = capsys.readouterr().err
    assert "--gamma 1.0 -> 0.99; --critic-lr None -> 1e-05." in err, err


def test_a_record_without_the_critics_settings_gives_no_note_for_them():
    run = RunConfig.from_args(parse_train_flags(["--advantage-estimator", "ppo", "--gamma", "0.5"]))
    old = {flag: value for flag, value in settings_of(run) if flag != "--gamma"}  # written before --gamma existed
    from rl_plugin.checkpoint.run_settings import changed_settings

    assert changed_settings(old, run) == []
