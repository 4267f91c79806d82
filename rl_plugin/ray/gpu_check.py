"""Fail loud when Ray gave a process GPUs it cannot use.

An actor placed on a GPU bundle gets GPU ids from Ray (``ray.get_gpu_ids()``, and
``CUDA_VISIBLE_DEVICES`` set from them) whether or not the node really has a usable GPU: a node
started with ``--num-gpus`` but no driver, a CPU-only torch build, a broken CUDA install. Without
this check the training rank would quietly fall back to gloo on the CPU (and the Megatron backend
would switch its CPU shim on). ``require_cuda(role)`` raises instead, naming the node.
"""

from __future__ import annotations

import os


class GPUPlacementError(RuntimeError):
    """A process placed on GPUs that sees no CUDA; the message names the node and the fix."""


def require_cuda(role: str) -> None:
    """Raise ``GPUPlacementError`` when this Ray worker holds GPU ids but torch sees no CUDA.
    Outside a Ray worker, or without GPU ids, nothing is checked."""
    import ray
    import torch

    if not ray.is_initialized():
        return
    gpu_ids = list(ray.get_gpu_ids())
    if not gpu_ids or torch.cuda.is_available():
        return
    ctx = ray.get_runtime_context()
    raise GPUPlacementError(
        f"{role} was placed on a GPU bundle (Ray GPU ids {gpu_ids}, CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}) on node {ray.util.get_node_ip_address()} "
        f"(node id {ctx.get_node_id()}), but this process sees no CUDA (torch {torch.__version__}, "
        f"CUDA build {torch.version.cuda}). Fix: on that node install a CUDA build of torch and check "
        "`nvidia-smi`, or restart the node's Ray with its real GPU count (`ray start --num-gpus`), or "
        "train on CPUs with --placement-device cpu"
    )
