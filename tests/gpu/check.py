"""The one-GPU check (``scripts/gpu_check.sh``): every case in its own process with its own timeout,
within one time budget, results into one JSON and one log. See ``tests/gpu/README.md``.

    python -m tests.gpu.check --out DIR [--device cuda|cpu] [--dry-run] [--only a,b] [--budget-s 420]

``DIR/gpu_check.json``: ``{"device", "dry_run", "versions", "total_s", "cases": {name: {"status":
ok|fail|error|timeout|skipped, "seconds", "result" | "error"}}}``; ``DIR/gpu_check.log``: each
case's output. A case that hangs is killed at its timeout (its whole process group) and the next one
runs; a case that would start with less than ``MIN_START_S`` of the budget left is skipped. A case
runs in a session of its own, so a signal to the driver's group does not reach it: when the driver
is stopped (the script's outer ``timeout``, SIGTERM, SIGHUP, Ctrl-C) it kills the running case's
whole group before it ends, and it names that group in ``CASE_PGID_ENV``'s file, which the script
kills on its way out too (a driver killed outright).

``--dry-run`` (with ``--device cpu``): tiny shapes, one step, the same code paths on the CPU
(``tests/fast/test_gpu_check_dry_run.py`` runs it so it cannot rot). ``--block-imports ray,vllm``
makes those packages unimportable in every case process, as on the loaned GPU machine.
``--in-process``: run the cases in this process one after another (no isolation; the dry-run test).
``--extra-case name=module:function`` adds a case (the dry-run test's case that never returns).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.gpu.common import IN_PROCESS_ENV, ROOT, Ctx

# (name, "module:function", timeout seconds, packages it needs beyond the GPU machine's own)
CASES = (
    ("env", "tests.gpu.check:env", 30, ()),
    ("fsdp_parity", "tests.gpu.cases_train:fsdp_parity", 100, ()),
    ("megatron_parity", "tests.gpu.cases_train:megatron_parity", 100, ("megatron.core", "mbridge")),
    ("fused_head", "tests.gpu.cases_head:fused_head", 60, ()),
    ("hf_engine", "tests.gpu.cases_rollout:hf_engine", 75, ()),
    ("shared_memory_sync", "tests.gpu.cases_rollout:shared_memory_sync", 60, ()),
    ("distributed_sync", "tests.gpu.cases_rollout:distributed_sync", 60, ()),
    ("throughput_fsdp", "tests.gpu.cases_train:throughput_fsdp", 150, ()),
    ("throughput_megatron", "tests.gpu.cases_train:throughput_megatron", 150, ("megatron.core", "mbridge")),
)
MIN_START_S = 20
BLOCK_ENV = "RL_GPU_CHECK_BLOCK_IMPORTS"
CASE_PGID_ENV = "RL_GPU_CHECK_CASE_PGID_FILE"  # the script's file naming the running case's process group


class _Hidden:
    """A meta-path finder that finds nothing of the named top-level packages and defers the rest to
    the finder it wraps: ``import ray`` raises ModuleNotFoundError and
    ``importlib.util.find_spec("ray")`` is None, as where the package is not installed."""

    def __init__(self, finder, names):
        self.finder, self.names = finder, names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(fullname, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


def install_import_block() -> None:
    names = frozenset(n for n in os.environ.get(BLOCK_ENV, "").split(",") if n)
    if names and not any(isinstance(f, _Hidden) for f in sys.meta_path):
        sys.meta_path[:] = [_Hidden(f, names) for f in sys.meta_path]


def missing(packages) -> list:
    out = []
    for name in packages:
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(name)
    return out


def env(ctx: Ctx) -> dict:
    """What the machine has: versions, the GPU, the optional packages, /dev/shm."""
    import shutil

    import torch

    info = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda, device=ctx.device)
    for name in ("transformers", "peft", "triton", "megatron.core", "mbridge", "transformer_engine", "ray", "vllm"):
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "present")
        except ImportError:
            info[name] = None
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_mem_gib=props.total_memory / 2**30, sms=props.multi_processor_count)
        nccl = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    if os.path.isdir("/dev/shm"):
        info["dev_shm_free_gib"] = shutil.disk_usage("/dev/shm").free / 2**30
    return dict(ok=True, **info)


def run_case_here(name: str, fn: str, ctx: Ctx) -> dict:
    module, func = fn.split(":")
    install_import_block()
    return getattr(importlib.import_module(module), func)(ctx)


def _cases(opts) -> tuple:
    """CASES, and the ``--extra-case`` ones (timeout: the budget's)."""
    extra = [spec.split("=", 1) for spec in opts.extra_case]
    return CASES + tuple((name, fn, opts.budget_s, ()) for name, fn in extra)


def _child(opts) -> int:
    ctx = Ctx(opts.device, opts.dry_run, Path(opts.work))
    fn = dict((n, f) for n, f, _, _ in _cases(opts))[opts.child]
    try:
        result = dict(status=None, result=run_case_here(opts.child, fn, ctx))
        result["status"] = "ok" if result["result"].get("ok") else "fail"
    except Exception as e:  # noqa: BLE001 - a case's crash is its result
        traceback.print_exc()
        result = dict(status="error", error=f"{type(e).__name__}: {e}")
    Path(opts.result).write_text(json.dumps(result, default=str))
    return 0


def _run_isolated(name: str, timeout: float, opts, log) -> dict:
    result_file = Path(opts.work) / f"result-{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tests.gpu.check", "--child", name, "--device", opts.device]
    cmd += ["--work", opts.work, "--result", str(result_file)] + (["--dry-run"] if opts.dry_run else [])
    cmd += [f"--extra-case={spec}" for spec in opts.extra_case]
    log.write(f"\n===== {name} (timeout {timeout:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _name_case_group(proc.pid)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return dict(status="timeout", error=f"killed after {timeout:.0f} s")
    finally:  # the driver stopped (SystemExit from _stop_driver, KeyboardInterrupt): the case goes too
        if proc.returncode is None:
            _kill_group(proc)
        _name_case_group(None)
    if not result_file.exists():
        return dict(status="error", error=f"the case process exited {proc.returncode} without a result (see the log)")
    return json.loads(result_file.read_text())


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the case and every process it started (its session's group), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _name_case_group(pgid) -> None:
    """Name the running case's process group (None: none runs) in the script's file."""
    path = os.environ.get(CASE_PGID_ENV)
    if path:
        Path(path).write_text("" if pgid is None else f"{pgid}\n")


def _stop_driver(signum, frame) -> None:
    """SIGTERM / SIGHUP to the driver: unwind, so the running case's group is killed on the way."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for gpu_check.json and gpu_check.log")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, one step (the script's logic on a CPU)")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases after this many seconds")
    p.add_argument("--block-imports", default="", help="comma-separated packages made unimportable in the cases")
    p.add_argument("--in-process", action="store_true", help="run the cases (and their children) in this process")
    p.add_argument("--extra-case", action="append", default=[], help=argparse.SUPPRESS)  # name=module:function
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.block_imports:
        os.environ[BLOCK_ENV] = opts.block_imports
    if opts.in_process:
        os.environ[IN_PROCESS_ENV] = "1"  # the cases' own child processes too (common.run_child)
    if opts.child:
        return _child(opts)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_driver)
    if opts.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --dry-run to check the script's logic)")
    if not opts.out:
        p.error("--out DIR is required")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    opts.work = opts.work or tempfile.mkdtemp(prefix="rl_gpu_check_")
    cases = _cases(opts)
    names = [n for n in opts.only.split(",") if n] or [n for n, _, _, _ in cases]
    unknown = sorted(set(names) - {n for n, _, _, _ in cases})
    if unknown:
        p.error(f"--only: unknown case(s) {unknown}; choose from {[n for n, _, _, _ in cases]}")
    report = dict(device=opts.device, dry_run=opts.dry_run, work=opts.work, cases={})
    t_start = time.perf_counter()
    ctx = Ctx(opts.device, opts.dry_run, Path(opts.work))
    with open(out / "gpu_check.log", "a") as log:
        for name, fn, timeout, needs in cases:
            if name not in names:
                continue
            left = opts.budget_s - (time.perf_counter() - t_start)
            absent = missing(needs) if needs else []
            t0 = time.perf_counter()
            if absent:
                entry = dict(status="skipped", error=f"not installed: {absent} (carry tests/gpu/wheels, README)")
            elif left < MIN_START_S:
                entry = dict(status="skipped", error=f"time budget spent ({left:.0f} s left)")
            elif opts.in_process:
                try:
                    result = run_case_here(name, fn, ctx)
                    entry = dict(status="ok" if result.get("ok") else "fail", result=result)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc(file=log)
                    entry = dict(status="error", error=f"{type(e).__name__}: {e}")
            else:
                entry = _run_isolated(name, min(timeout, left), opts, log)
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            report["cases"][name] = entry
            line = f"[gpu_check] {name}: {entry['status']} in {entry['seconds']:.1f} s {entry.get('error', '')}"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            report["total_s"] = round(time.perf_counter() - t_start, 2)
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))  # after every case
    bad = [n for n, e in report["cases"].items() if e["status"] not in ("ok", "skipped")]
    print(f"[gpu_check] {len(report['cases'])} cases in {report['total_s']:.0f} s; not ok: {bad or 'none'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
