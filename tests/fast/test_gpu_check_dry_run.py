"""The GPU check (``scripts/gpu_check.sh`` -> ``tests.gpu.check``) cannot rot between GPU loans: its
every case runs here on the CPU (``--device cpu --dry-run``: tiny shapes, one step) with the
packages the loaned GPU machine lacks made unimportable (Ray, vLLM, SGLang, transformer-engine),
and writes the JSON the GPU run writes. The numbers are CPU ones; only the logic is checked."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("timeout") is None, reason="bash script, GNU timeout")
def test_the_outer_timeout_kills_the_running_case_and_its_children(tmp_path):
    """Issue 44 #13: a case runs in a session of its own; when the script's outer timeout ended the
    driver, the case (and what it started) kept running, holding the GPU. Now it goes too."""
    from tests.support.gpu_check_cases import PIDS_ENV

    pids_file, outer_s = tmp_path / "pids", 30  # the case starts in ~5 s (python, torch)
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        CUDA_VISIBLE_DEVICES="",
        RL_GPU_CHECK_TIMEOUT_S=str(outer_s),
        **{PIDS_ENV: str(pids_file)},
    )
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--device", "cpu", "--dry-run"]
    cmd += ["--extra-case", "hang=tests.support.gpu_check_cases:never_returns", "--only", "hang", "--budget-s", "400"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=outer_s + 120)
    seconds = time.monotonic() - t0
    assert pids_file.exists(), f"the case never started within {outer_s} s: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    pids = [int(x) for x in pids_file.read_text().split()]
    deadline = time.monotonic() + 10  # SIGKILLed: gone at once, reaped by init shortly after
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:  # never leave them behind, pass or fail
        os.kill(p, signal.SIGKILL)
    assert not left, f"left running after the outer timeout ({seconds:.0f} s): {left}"
    assert proc.returncode != 0 and seconds < outer_s + 60, (proc.returncode, seconds)
