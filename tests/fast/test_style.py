"""The tree follows the ruff configuration of ``pyproject.toml`` (``[tool.ruff]``): lint rules
(``ruff check``) and formatting (``ruff format --check``) over the package, the tests, the
benchmarks and the scripts. Fix a failure with ``python -m ruff check --fix`` and
``python -m ruff format`` on the files it names.

And two house rules ruff cannot hold (issue 43): the run's mode is derived in one module
(``rl_plugin/configs/mode.py``: the only place ``--loss-type`` is compared with ``sft_loss`` and
``--max-weight-staleness`` with a number), and nothing outside the command line
(``rl_plugin/arguments``) reads a flag off the namespace with ``getattr(args, ...)``."""

from __future__ import annotations

import re
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


PACKAGE = ROOT / "rl_plugin"
MODE_MODULE = "configs/mode.py"
# a comparison that decides the mode: --loss-type against a value (or sft_loss against anything),
# --max-weight-staleness against a number
MODE_DECISION = re.compile(
    r"loss_type\s*(?:[!=]=|\bin\b|\bnot in\b)|[!=]=\s*[\"']sft_loss|[\"']sft_loss[\"']\s*[!=]="
    r"|max_weight_staleness\s*(?:[<>]=?|[!=]=)|(?:[<>]=?|[!=]=)\s*\S*max_weight_staleness\b"
)
NAMESPACE_READ = re.compile(r"getattr\(\s*args\b")
# the user hooks receive the namespace by contract (slime's ``fn(args, ...)``); a call site that
# must read it goes here, named (none does today: ``rl_plugin.configs.run``)
HOOK_CALL_SITES: tuple = ()


def _lines(pattern: re.Pattern, allowed) -> list:
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if allowed(rel):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"rl_plugin/{rel}:{n}: {line.strip()}")
    return hits


def test_the_mode_is_derived_in_one_module():
    hits = _lines(MODE_DECISION, lambda rel: rel == MODE_MODULE)
    assert not hits, "the run's mode decided outside rl_plugin/" + MODE_MODULE + " (read run.mode):\n" + "\n".join(hits)
    assert _lines(MODE_DECISION, lambda rel: rel != MODE_MODULE), "the pattern no longer finds the mode module's own"


def test_no_namespace_read_below_the_command_line():
    hits = _lines(NAMESPACE_READ, lambda rel: rel.startswith("arguments/") or rel in HOOK_CALL_SITES)
    assert not hits, "a flag read off the namespace below the CLI (take it from the run config):\n" + "\n".join(hits)
