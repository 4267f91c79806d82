"""Issue 16, the first hour of a user: what the trainer says, before Ray starts, about bad
input that used to fail late, silently, or by losing work. Each case runs the real entry point
(``rl_plugin.train.main``) with ``ray.init`` made to raise, so a check that fires only after
the cluster starts fails the test. Plus the pieces the driver uses on resume and per step
(superseded metrics rows, the summary line, the run lock, reward errors with file:line).

The spawned-process faults (Ctrl-C, SIGKILL, a second live run) are in cli/test_cli_faults.py; the
resume/mismatch cases that need train actors in e2e/test_loop.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rl_plugin.checkpoint.commit import write_loop_state, write_tracker
from rl_plugin.checkpoint.layout import step_dir
from rl_plugin.loop.logger import read_metrics, summary_line, supersede_after
from rl_plugin.loop.run_lock import RunLock
from rl_plugin.rollout.rewards.functions import RewardFunctionError, load_reward_fn, score_responses
from rl_plugin.train import main


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    """``main`` with the embedded cache in tmp and Ray forbidden: every case must be refused first."""
    import ray

    def forbidden(*a, **k):
        raise AssertionError("the check ran after Ray started; it must run in the driver's first second")

    monkeypatch.setattr(ray, "init", forbidden)
    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _refused(capsys, argv, *fragments, code=2):
    assert main(argv) == code
    err = capsys.readouterr().err
    for f in fragments:
        assert f in err, f"{f!r} not in {err!r}"
    if code == 2:
        assert "Fix:" in err
    return err


def _fake_ckpt(root: Path, step: int, *, backend: str, next_rollout: int | None = None) -> Path:
    d = Path(step_dir(root, step))
    d.mkdir(parents=True)
    if backend == "fsdp":  # DCP's metadata + the FSDP backend's meta.pt
        (d / ".metadata").write_bytes(b"")
        (d / "meta.pt").write_bytes(b"")
    else:  # the Megatron backend: <step dir>/latest + iter_*/rank_*.pt
        (d / f"iter_{step:07d}").mkdir()
        (d / f"iter_{step:07d}" / "rank_00000.pt").write_bytes(b"")
        (d / "latest").write_text(str(step))
    if next_rollout is not None:
        write_loop_state(step_dir(root, step), {"step": step, "next_rollout": next_rollout, "train_backend": backend})
    write_tracker(root, step)
    return d


BASE = ["--train-backend", "fsdp", "--no-progress-bar", "--num-rollout", "3"]


def test_save_over_another_runs_checkpoints_is_refused(no_ray, capsys):
    """#1: --save DIR with checkpoints and no --load would overwrite them and move the resume point back."""
    save = no_ray / "ckpt"
    _fake_ckpt(save, 30, backend="fsdp")
    _refused(
        capsys,
        [*BASE, "--save", str(save), "--output-dir", str(no_ray / "o")],
        f"--save {save}",
        "up to step 30",
        f"--load {save}",
        "--overwrite-save",
    )
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "30"


def test_overwrite_save_moves_the_old_checkpoints_aside(no_ray, capsys):
    """#1's explicit way out: nothing is deleted, the tracker and iter_* dirs move to overwritten_1/."""
    save = no_ray / "ckpt"
    _fake_ckpt(save, 30, backend="fsdp")
    with pytest.raises(AssertionError, match="after Ray started"):  # got past every check, to Ray
        main([*BASE, "--save", str(save), "--overwrite-save", "--output-dir", str(no_ray / "o")])
    assert sorted(p.name for p in save.iterdir()) == ["overwritten_1"]
    assert (save / "overwritten_1" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    assert (save / "overwritten_1" / "iter_0000030" / "meta.pt").exists()
    assert not (no_ray / "o" / ".rl_plugin.lock").exists()  # released on the way out


def test_load_of_a_missing_directory_is_an_error(no_ray, capsys):
    """#2: a typo in --load used to train from scratch and exit 0."""
    missing = no_ray / "ckpt_typo"
    _refused(capsys, [*BASE, "--load", str(missing)], f"--load {missing}: the directory does not exist", "mkdir -p")
    _refused(
        capsys,
        [*BASE, "--load", str(_fake_ckpt(no_ray / "c", 4, backend="fsdp"))],
        "--load takes the --save directory",
        f"--load {no_ray / 'c'}",
    )
    partial = no_ray / "c" / "iter_0000005.partial"
    partial.mkdir()
    _refused(capsys, [*BASE, "--load", str(partial)], "unfinished save", f"pass --load {no_ray / 'c'}")


def test_checkpoint_of_the_other_backend_names_it(no_ray, capsys):
    """#9: an FSDP checkpoint given to the Megatron backend said "no 'latest' file there"."""
    _fake_ckpt(no_ray / "f", 6, backend="fsdp")
    _refused(
        capsys,
        [*BASE, "--train-backend", "megatron", "--load", str(no_ray / "f")],
        "written by the fsdp backend",
        "resume with --train-backend fsdp",
    )
    _fake_ckpt(no_ray / "m", 6, backend="megatron")
    _refused(
        capsys,
        [*BASE, "--load", str(no_ray / "m")],
        "written by the megatron backend",
        "resume with --train-backend megatron",
    )


def test_finished_run_says_so(no_ray, capsys):
    """#10: --load of a finished run with --num-rollout at or below its progress trained nothing silently."""
    _fake_ckpt(no_ray / "c", 6, backend="fsdp", next_rollout=3)
    _refused(
        capsys,
        [*BASE, "--num-rollout", "2", "--load", str(no_ray / "c")],
        "has already done 3 rollouts, more than --num-rollout",
        "pass --num-rollout 5 to train 2 more",
    )
    assert main([*BASE, "--load", str(no_ray / "c")]) == 0
    assert "the run is complete" in capsys.readouterr().out


def _data(tmp: Path, lines) -> Path:
    p = tmp / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": x, "label": "1"}) + "\n" for x in lines))
    return p


def test_prompt_too_long_or_unencodable_is_named_by_file_line(no_ray, capsys):
    """#5: checked for the whole file at start-up (the tiny model has 64 positions)."""
    from rl_plugin.loop.embedded_setup import ensure_tiny_model

    model = str(ensure_tiny_model(no_ray / "cache"))
    common = [
        *BASE,
        "--hf-checkpoint",
        model,
        "--rollout-batch-size",
        "1",
        "--rollout-max-response-len",
        "4",
        "--rm-type",
        "digit_match",
    ]
    data = _data(no_ray, ["12=", "1" * 58 + "=", "3=", "2" * 70 + "="])
    # 58 digits + = + <bos> = 60 tokens, + 4 = 64: fits exactly; line 4 (72 tokens) does not
    _refused(
        capsys,
        [*common, "--prompt-data", str(data)],
        f"--prompt-data {data}:4",
        "76 tokens",
        "64 positions",
        "max_position_embeddings",
    )
    _refused(
        capsys, [*common, "--prompt-data", str(data), "--rollout-max-response-len", "5"], f"{data}:2", "lines 2, 4"
    )
    data = _data(no_ray, ["12=", "1a="])
    _refused(capsys, [*common, "--prompt-data", str(data)], f"--prompt-data {data}:2", "cannot encode", "'a'")


def test_reward_module_errors_name_file_and_line(no_ray, capsys):
    """#7: a syntax error printed only "SyntaxError: expected ':'"; an import-time error its type."""
    bad = no_ray / "bad_rm.py"
    bad.write_text("import math\n\ndef reward(prompt, response, label)\n    return 1.0\n")
    _refused(
        capsys,
        [*BASE, "--custom-rm-path", f"{bad}:reward"],
        f"--custom-rm-path {bad}:reward",
        f"{bad}:3",
        "SyntaxError",
        "def reward(prompt, response, label)",
    )
    bad.write_text("TABLE = {}\nSCALE = TABLE['scale']\n\ndef reward(prompt, response, label):\n    return 1.0\n")
    _refused(capsys, [*BASE, "--custom-rm-path", f"{bad}:reward"], "failed to import", "KeyError: 'scale'", f"{bad}:2")


def test_reward_that_raises_names_file_line_sample_and_prompt(tmp_path):
    """#7: a raising reward printed only "KeyError: 'no_such_field'"."""
    rm = tmp_path / "rm.py"
    rm.write_text(
        "def reward(prompt, response, label):\n    if prompt.startswith('9'):\n        return label['no_such_field']\n    return 0.5\n"
    )
    fn = load_reward_fn(None, f"{rm}:reward")
    assert score_responses(fn, ["12="], ["12"], ["12"]) == [0.5]
    with pytest.raises(RewardFunctionError) as err:
        score_responses(fn, ["12=", "12=", "93="], ["1", "2", "3"], [{}, {}, {}])
    msg = str(err.value)
    for fragment in (
        f"--custom-rm-path {rm}:reward raised KeyError: 'no_such_field'",
        f"at {rm}:3",
        "sample 2",
        "prompt '93='",
        "Fix:",
    ):
        assert fragment in msg, msg
    assert "\n" not in msg  # one line: the driver shows the remote error line


def test_static_flag_checks_in_the_checker_and_the_first_second(no_ray, capsys):
    """#8: checks that used to fire after ~13 s of Ray and model start-up."""
    from rl_plugin.arguments.__main__ import main as check

    cases = [
        (["--global-batch-size", "24"], "= 16 x 8 = 128 samples must split into whole optimizer steps"),
        (
            [
                "--prompt-data",
                str(no_ray / "none.jsonl"),
                "--rollout-batch-size",
                "2",
                "--rollout-max-response-len",
                "4",
                "--num-rollout",
                "1",
                "--rm-type",
                "math_exact",
                "--hf-checkpoint",
                str(no_ray),
            ],
            "--prompt-data",
        ),
        (["--custom-rm-path", f"{no_ray / 'none.py'}:f"], "none.py does not exist"),
        (["--load", str(no_ray / "none")], "the directory does not exist"),
        (["--lr", "-1"], "--lr: must be >= 0.0 (got -1.0)"),
        (["--adam-beta1", "2"], "--adam-beta1: must be in [0.0, 1.0) (got 2.0)"),
        (["--clip-grad", "-1"], "--clip-grad: must be >= 0.0 (got -1.0)"),
        (["--save-interval", "-3"], "--save-interval: must be >= 1 (got -3)"),
        (["--eps-clip-high", "0.1"], "--eps-clip-high 0.1 with --eps-clip 0.2"),
        (
            ["--actor-num-gpus-per-node", "2", "--micro-batch-size", "4", "--global-batch-size", "4"],
            "multiple of micro-batch-size x DP = 8",
        ),
    ]
    for flags, fragment in cases:
        assert check(flags) == 2, flags
        assert fragment in capsys.readouterr().err, flags
        _refused(capsys, [*BASE, *flags], fragment)


def test_checker_cli_runs_the_path_checks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rl_plugin.arguments", "--load", str(tmp_path / "typo")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and f"--load {tmp_path / 'typo'}: the directory does not exist" in proc.stderr


def test_resume_supersedes_rows_past_the_checkpoint(tmp_path):
    """#4: the interrupted run's steps after the checkpoint move to *.superseded.jsonl; the rest is kept byte for byte."""
    m = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": s / 10} for s in range(1, 7)] + [{"step": 4, "eval/reward_mean": 0.5}]
    m.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    (tmp_path / "metrics.timings.jsonl").write_text(
        "".join(json.dumps({"step": s, "time/train": 1.0}) + "\n" for s in range(1, 7))
    )
    before = m.read_text().splitlines()
    assert supersede_after(m, 4) == [5, 6]
    assert m.read_text().splitlines() == [ln for ln in before if json.loads(ln)["step"] <= 4]
    sup = read_metrics(tmp_path / "metrics.superseded.jsonl")
    assert [(r["step"], r["loss"], r["superseded_by_resume_from"]) for r in sup] == [(5, 0.5, 4), (6, 0.6, 4)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.timings.jsonl")] == [1, 2, 3, 4]
    assert supersede_after(m, 4) == []  # idempotent


def test_summary_line():
    line = summary_line(
        12,
        {"rollout_id": 5, "reward_mean": 0.41234, "loss": -0.0123, "grad_norm": 0.53, "lr": 1e-3},
        {"time/rollout_generate": 0.81, "time/rollout_reward": 2.5, "time/train": 1.2},
    )
    assert (
        line
        == "step 12 | rollout 5 | reward 0.412 | loss -0.0123 | grad_norm 0.53 | lr 0.001 | gen 0.81s reward 2.50s train 1.20s"
    )


def test_run_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path):
    """#3: the lock names the live owner; a SIGKILLed run's lock (dead pid) is taken over."""
    from rl_plugin.arguments import RLArgumentError

    first = RunLock(tmp_path).acquire()
    with pytest.raises(RLArgumentError, match=rf"another run is writing there: pid {os.getpid()} on "):
        RunLock(tmp_path).acquire()
    first.release()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / ".rl_plugin.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x", "argv": []}))
    second = RunLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    second.release()
    assert not lock.exists()
