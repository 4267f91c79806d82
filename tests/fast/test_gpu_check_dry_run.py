"""The GPU check (``scripts/gpu_check.sh`` -> ``tests.gpu.check``) cannot rot between GPU loans: its
every case runs here on the CPU (``--device cpu --dry-run``: tiny shapes, one step) with the
packages the loaned GPU machine lacks made unimportable (Ray, vLLM, SGLang, transformer-engine),
and writes the JSON the GPU run writes. The numbers are CPU ones; only the logic is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = "ray,vllm,sglang,transformer_engine"


def _run(out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "tests.gpu.check", "--device", "cpu", "--dry-run", "--out", str(out)]
    cmd += ["--block-imports", BLOCKED, *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_every_case_runs_on_the_cpu_without_the_missing_packages(tmp_path):
    from tests.gpu.check import CASES

    proc = _run(tmp_path, "--in-process")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(report["cases"]) == [c[0] for c in CASES]
    bad = {n: e for n, e in report["cases"].items() if e["status"] != "ok"}
    assert not bad, json.dumps(bad, indent=1)
    env = report["cases"]["env"]["result"]
    assert env["ray"] is None and env["vllm"] is None and env["transformer_engine"] is None
    shapes = report["cases"]["throughput_fsdp"]["result"]["shapes"]
    assert shapes["tiny"]["tokens_per_s"] > 0
    assert report["cases"]["megatron_parity"]["result"]["masked_softmax_fusion_off"] is True


def test_a_case_runs_isolated_and_a_budget_skips(tmp_path):
    """The GPU run's mode: each case in its own process (result file), and a case's own child
    processes (a throughput shape) under it; no budget left: skipped."""
    proc = _run(tmp_path, "--only", "throughput_fsdp")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    entry = report["cases"]["throughput_fsdp"]
    assert proc.returncode == 0 and entry["status"] == "ok", proc.stdout + proc.stderr
    assert entry["result"]["shapes"]["tiny"]["tokens"] > 0
    proc = _run(tmp_path / "none", "--only", "env", "--budget-s", "1")
    entry = json.loads((tmp_path / "none" / "gpu_check.json").read_text())["cases"]["env"]
    assert entry["status"] == "skipped" and "time budget" in entry["error"]


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_the_shell_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "fetch_gpu_wheels.sh")]).returncode == 0
