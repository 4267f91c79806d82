"""``pytest tests/gpu``: the GPU check's cases as tests, on a machine with CUDA (skipped without).

Each case runs in its own process through ``tests.gpu.check`` (as ``scripts/gpu_check.sh`` runs
them), its result JSON under pytest's tmp folder. ``scripts/gpu_check.sh`` is the one command for a
loaned machine (it also installs the carried wheels and keeps to the 8-minute budget); this file is
for a GPU machine of one's own."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/gpu/README.md)")

from tests.gpu.check import CASES, main  # noqa: E402

NCCL_REFUSAL = "nccl refuses two ranks on one GPU"


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_case(name, tmp_path):
    main(["--only", name, "--out", str(tmp_path), "--budget-s", "600"])
    entry = json.loads((tmp_path / "gpu_check.json").read_text())["cases"][name]
    if entry["status"] == "skipped":
        pytest.skip(entry["error"])
    result = entry.get("result", {})
    if name == "distributed_sync" and result.get("status") == NCCL_REFUSAL:
        pytest.xfail(f"{NCCL_REFUSAL}: {result.get('sender_error') or result.get('receiver')}")
    assert entry["status"] == "ok", json.dumps(entry, indent=1, default=str)
