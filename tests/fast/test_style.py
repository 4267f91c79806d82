"""The tree follows the ruff configuration of ``pyproject.toml`` (``[tool.ruff]``): lint rules
(``ruff check``) and formatting (``ruff format --check``) over the package, the tests, the
benchmarks and the scripts. Fix a failure with ``python -m ruff check --fix`` and
``python -m ruff format`` on the files it names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["rl_plugin", "tests", "benchmarks", "scripts"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "command", [("check", "--no-cache"), ("format", "--check", "--no-cache")], ids=["check", "format"]
)
def test_ruff(command):
    out = _ruff(*command)
    assert out.returncode == 0, f"ruff {' '.join(command)}:\n{out.stdout}{out.stderr}"
