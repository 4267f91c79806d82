"""A case for the GPU check's driver tests (``tests/fast/test_gpu_check_dry_run.py``): one that never
returns, as a hung kernel or a deadlocked collective would, with a child of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PIDS_ENV = "RL_GPU_CHECK_TEST_PIDS"  # the file the case writes "its pid, its child's pid" into


def never_returns(ctx) -> dict:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(os.environ[PIDS_ENV]).write_text(f"{os.getpid()} {child.pid}\n")
    time.sleep(3600)
    return dict(ok=False)
