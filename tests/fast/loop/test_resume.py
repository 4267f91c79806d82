"""Resume and save (``rl_plugin.loop.resume``): the resume command and hint the run prints when it
stops, a checkpoint's loop state and retention, a backend's refusal of the checkpoint turned into
an argument error, the rollout generated ahead read back (and refused when it does not follow the
checkpoint), and the metrics lines past the checkpoint moved aside."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.checkpoint.layout import latest_step, read_loop_state, step_dir
from rl_plugin.checkpoint.pending_rollout import PENDING_ROLLOUT, PendingRollout
from rl_plugin.errors import LoopError, RLArgumentError
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.resume import (
    Progress,
    load_train_state,
    read_pending,
    resume_command,
    resume_hint,
    save_checkpoint,
    supersede_metrics,
)
from rl_plugin.ray.train_group import TrainActorError
from rl_plugin.rollout.sample import RolloutData


class OneRankGroup:
    """The train group's save/load as the loop sees them, for one rank that writes no file."""

    world_size = 1
    info = [{"ip": "127.0.0.1"}]

    def __init__(self, load_error=None):
        self.load_error = load_error

    def save(self, path, step, extra):
        return [[]]

    def load(self, path):
        if self.load_error:
            raise self.load_error
        return [{"step": 2, "path": path}]


def _cfg(tmp_path, *flags):
    return LoopConfig.from_args(parse_train_flags(["--output-dir", str(tmp_path / "out"), *flags]))


def _rollout(num_groups):
    return RolloutData(
        tokens=torch.arange(3 * num_groups),
        total_lengths=torch.full((num_groups,), 3),
        response_lengths=torch.ones(num_groups, dtype=torch.long),
        rollout_log_probs=torch.zeros(num_groups),
        rewards=torch.zeros(num_groups),
        group_ids=torch.arange(num_groups),
        num_groups=num_groups,
    )


def test_resume_command_replaces_load_and_drops_overwrite_save():
    argv = ["--lr", "1e-6", "--load", "/old", "--overwrite-save", "--load=/older", "--prompt-data", "a b.jsonl"]
    cmd = resume_command(argv, "/ckpt")
    assert cmd == "rl-plugin-train --lr 1e-6 --prompt-data 'a b.jsonl' --load /ckpt"
    assert shlex.split(cmd)[-4:] == ["--prompt-data", "a b.jsonl", "--load", "/ckpt"]


def test_save_then_the_hint_names_the_last_checkpoint_and_retention_deletes_older_ones(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    cfg = _cfg(tmp_path, "--save", save, "--num-rollout", "9", "--save-retain", "1")
    assert resume_hint(cfg, []) == (
        "No step was completed; no checkpoint was written yet, so a new run starts from the beginning"
    )
    save_checkpoint(cfg, OneRankGroup(), Progress(step=2, samples_seen=64), 1, {"epoch": 0, "offset": 32}, None)
    state = read_loop_state(save, 2)
    assert (state["step"], state["next_rollout"], state["samples_seen"], state["num_rollout"]) == (2, 2, 64, 9)
    assert "pending_rollout" not in state
    pending = PendingRollout(3, _rollout(2), staleness=1)
    save_checkpoint(cfg, OneRankGroup(), Progress(step=4, samples_seen=128), 2, {"epoch": 0, "offset": 64}, pending)
    assert read_loop_state(save, 4)["pending_rollout"] == PENDING_ROLLOUT
    assert "--save-retain 1: deleted the checkpoints of steps [2]" in capsys.readouterr().out
    assert latest_step(save) == 4 and read_loop_state(save, 2) is None
    cfg.metrics_file.parent.mkdir(parents=True)
    cfg.metrics_file.write_text('{"step": 1}\n')
    assert resume_hint(cfg, ["--save", save]) == (
        f"Completed steps are in {cfg.metrics_file}; resume with --load {save} (last checkpoint: step 4): "
        f"rl-plugin-train --save {save} --load {save}"
    )
    assert resume_hint(_cfg(tmp_path), []) == (
        f"Completed steps are in {cfg.metrics_file}; no checkpoint was written "
        "(pass --save DIR --save-interval N to make runs resumable)"
    )


def test_a_checkpoint_the_backend_refuses_is_an_argument_error(tmp_path):
    assert load_train_state(OneRankGroup(), "/ckpt", 2) == {"step": 2, "path": step_dir("/ckpt", 2)}
    refused = TrainActorError(
        0,
        "load",
        "x",
        died=False,
        error_line="RuntimeError: --load /ckpt holds another model. Fix: pass its --hf-checkpoint",
    )
    with pytest.raises(RLArgumentError, match=r"^--load /ckpt holds another model\. Fix: pass its --hf-checkpoint$"):
        load_train_state(OneRankGroup(refused), "/ckpt", 2)
    died = TrainActorError(0, "load", "SIGKILL", died=True)
    with pytest.raises(TrainActorError, match=r"train actor rank 0 died during load: SIGKILL"):
        load_train_state(OneRankGroup(died), "/ckpt", 2)


def test_the_rollout_generated_ahead_is_read_back_and_checked(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    cfg = _cfg(tmp_path, "--save", save, "--load", save, "--num-rollout", "9")
    assert read_pending(cfg, 2, 2, 16) is None  # no checkpoint at step 2 holds one
    save_checkpoint(cfg, OneRankGroup(), Progress(step=2), 1, {}, PendingRollout(2, _rollout(4), staleness=1))
    got = read_pending(cfg, 2, 2, 4)
    assert got.rollout_id == 2 and got.staleness == 1 and torch.equal(got.data.tokens, torch.arange(12))
    out = capsys.readouterr().out
    assert (
        "resuming: rollout 2 was generated ahead before the checkpoint and is trained on as it was (staleness 1)" in out
    )
    assert "note:" not in out
    read_pending(cfg, 2, 2, 8)  # this run asks for 8 prompt groups per rollout
    assert (
        "note: that rollout has 4 prompt groups, generated with the interrupted run's --rollout-batch-size; "
        "this run's 8 applies from rollout 3 on"
    ) in capsys.readouterr().out
    with pytest.raises(LoopError) as err:
        read_pending(cfg, 2, 5, 4)
    assert str(err.value) == (
        f"{step_dir(save, 2)}/{PENDING_ROLLOUT} holds rollout 2, but the checkpoint's next rollout is 5: "
        "the checkpoint is inconsistent; resume from an earlier one"
    )


def test_metrics_past_the_checkpoint_are_moved_aside(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    cfg.metrics_file.parent.mkdir(parents=True)
    cfg.metrics_file.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in (1, 2, 3, 4)))
    supersede_metrics(cfg, 2)
    assert [json.loads(line)["step"] for line in cfg.metrics_file.read_text().splitlines()] == [1, 2]
    moved = [json.loads(line) for line in (cfg.output_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [(r["step"], r["superseded_by_resume_from"]) for r in moved] == [(3, 2), (4, 2)]
    assert capsys.readouterr().out == (
        f"{cfg.metrics_file}: steps 3-4 were written after the checkpoint by the interrupted run and are trained "
        "again now; their lines moved to metrics.superseded.jsonl\n"
    )
    supersede_metrics(cfg, 2)  # nothing past step 2 any more: no line printed
    assert capsys.readouterr().out == ""


def test_ppo_resume_command_names_the_critics_checkpoints_too():
    argv = ["--advantage-estimator", "ppo", "--critic-load", "/init", "--load=/old"]
    cmd = resume_command(argv, "/ckpt", "/ckpt/critic")
    assert cmd == "rl-plugin-train --advantage-estimator ppo --load /ckpt --critic-load /ckpt/critic"


def test_ppo_saves_the_critic_beside_the_actor_and_resumes_it_at_the_actors_step(tmp_path):
    from rl_plugin.loop.resume import load_critic_state, save_critic_checkpoint

    save = tmp_path / "ckpt"
    cfg = _cfg(tmp_path, "--advantage-estimator", "ppo", "--save", str(save), "--num-rollout", "9")
    assert cfg.critic_save == str(save / "critic") and cfg.critic is not None
    assert _cfg(tmp_path).critic is None and _cfg(tmp_path).critic_save is None  # no PPO: no critic
    save_critic_checkpoint(cfg.critic_save, OneRankGroup(), Progress(step=4), 3, None, None)
    assert read_loop_state(cfg.critic_save, 4)["role"] == "critic"
    # a critic step alone is no resume point: the actor's commit is
    assert resume_hint(cfg, []).endswith("no checkpoint was written yet, so a new run starts from the beginning")
    assert load_critic_state(OneRankGroup(), cfg.critic_save, 4) == 4
    assert load_critic_state(OneRankGroup(), cfg.critic_save, None) == 4  # a given critic's latest
    assert load_critic_state(OneRankGroup(), str(tmp_path / "none"), None) is None  # a fresh head
    with pytest.raises(RLArgumentError) as err:
        load_critic_state(OneRankGroup(), cfg.critic_save, 6)
    assert str(err.value).startswith(
        f"--load resumes the actor at step 6, but the critic's checkpoint directory {cfg.critic_save} holds no "
        "step 6 (latest: 4): the actor and the critic must resume from the same rollout. Fix: "
    )
