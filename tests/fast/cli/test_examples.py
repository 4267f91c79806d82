"""Every training shell in examples/ passes the argument checker.

Each script runs under real bash with ``RL_PLUGIN_TRAIN`` pointing at a stub that records the
expanded argument list (and ``PREPARE=0``: no model download or data generation); the list then goes through ``python -m rl_plugin.arguments`` (exit 0).
"""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.sh"))


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert {
        "cpu_tiny.sh",
        "gspo_qwen2.5_7b.sh",
        "dr_grpo_qwen2.5_7b.sh",
        "dapo_token_mean_qwen2.5_7b.sh",
        "prompt_mean_qwen2.5_7b.sh",
    } <= names


def _flags(script: Path, tmp_path: Path):
    out = tmp_path / "argv"
    stub = tmp_path / "stub.sh"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{out}"\n')
    stub.chmod(0o755)
    subprocess.run(
        ["bash", str(script)],
        check=True,
        env={"PATH": "/usr/bin:/bin", "RL_PLUGIN_TRAIN": str(stub), "PREPARE": "0"},
        cwd=tmp_path,
    )
    return [a for a in out.read_text().split("\0") if a]


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_flags_validate(script, tmp_path):
    argv = _flags(script, tmp_path)
    assert "--train-backend" in argv and len(argv) > 10
    res = subprocess.run(
        [sys.executable, "-m", "rl_plugin.arguments", "--no-file-checks", *argv], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_checker_rejects_a_broken_example(tmp_path):
    """The check can fail: Dr.GRPO's constant aggregation without its divisor exits 2."""
    argv = _flags(next(p for p in EXAMPLES if p.name.startswith("dr_grpo")), tmp_path)
    i = argv.index("--loss-aggregation-divisor")
    del argv[i : i + 2]
    res = subprocess.run(
        [sys.executable, "-m", "rl_plugin.arguments", "--no-file-checks", *argv], capture_output=True, text=True
    )
    assert res.returncode == 2 and "--loss-aggregation-divisor" in res.stderr
