"""Issue 28 #3: unwritable or full disks are named before Ray starts, and a save that runs out of
space says so and removes its ``.partial``.

Real file systems: small tmpfs mounts (read-only, 0.5 MiB, 2 MiB); the module is skipped where
this process may not mount (not root, or no CAP_SYS_ADMIN). The embedded model has ~85k
parameters: one checkpoint takes ~1.2 MiB, the preflight floor is 12 bytes per parameter (~1 MiB).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_plugin.checkpoint.layout import latest_step

TRAIN = [sys.executable, "-m", "rl_plugin.train", "--train-backend", "fsdp", "--no-progress-bar"]


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the disk checks need one")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)
    e["RL_PLUGIN_CACHE"] = str(tmp_path / "cache")
    return e


def _train(env, cwd, *argv, timeout=900):
    return subprocess.run(TRAIN + list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_read_only_output_dir_and_save_are_named_before_ray(env, tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        out = _train(env, tmp_path, "--num-rollout", "2", "--output-dir", str(ro / "out"))
        assert out.returncode == 2, out.stderr[-2000:]
        assert f"--output-dir {ro / 'out'}: the run cannot write there (Read-only file system)" in out.stderr
        out = _train(env, tmp_path, "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), "--save", str(ro))
        assert out.returncode == 2, out.stderr[-2000:]
        assert f"--save {ro}: the run cannot write there (Read-only file system)" in out.stderr
        assert "Traceback" not in out.stderr and "ray" not in out.stdout.lower()


def test_save_without_room_for_one_checkpoint_is_refused_before_ray(env, tmp_path):
    with tmpfs(tmp_path / "small", "512k") as small:
        out = _train(env, tmp_path, "--num-rollout", "2", "--output-dir", str(tmp_path / "out"), "--save", str(small))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"--save {small}: its file system has 0.5 MiB free, and one checkpoint of" in out.stderr, out.stderr[-2000:]
    assert "12 bytes per parameter" in out.stderr and "Fix:" in out.stderr


def test_a_save_that_runs_out_of_space_says_so_and_removes_its_partial(env, tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        save = disk / "ckpt"
        out = _train(
            env,
            tmp_path,
            "--num-rollout",
            "4",
            "--save-interval",
            "1",
            "--output-dir",
            str(tmp_path / "out"),
            "--save",
            str(save),
        )
        assert out.returncode == 1, out.stderr[-3000:]
        last = [ln for ln in out.stderr.splitlines() if ln.strip()][-1]
        assert "error: saving step 2 failed: no space left on the device of --save" in last, last
        assert "The unfinished save" in last and "was removed" in last and "resume with --load" in last, last
        assert latest_step(save) == 1  # the first checkpoint stays the resume point
        assert not list(save.glob("*.partial")), list(save.iterdir())
