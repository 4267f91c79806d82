"""What the GPU check's cases share: the run context, one-process torch.distributed, the models
(random weights, written as HF checkpoints: no download on the GPU machine), the step batch, timing
and the comparison record.

``Ctx``: ``device`` ("cuda", or "cpu" for the dry run), ``dry_run`` (tiny shapes, one step: the
script's logic on a CPU, ``tests/fast/test_gpu_check_dry_run.py``), ``work`` (a scratch folder the
cases of one run share: checkpoints, the CPU reference).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]

# Model shapes (HF configs, random weights). "parity": small enough for a CPU fp32 reference step
# in seconds; the timing shapes are the real models' (SmolLM2-135M: Llama, tied; Qwen2-0.5B).
SHAPES = {
    "tiny": dict(
        family="qwen2", vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    ),
    "parity": dict(
        family="qwen2",
        vocab_size=1024,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=704,
    ),
    "smollm2-135m": dict(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen2-0.5b": dict(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
}

IN_PROCESS_ENV = "RL_GPU_CHECK_IN_PROCESS"

# Dense bf16 peak of the GPUs this project is lent (NVIDIA's datasheets, SXM, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


@dataclass
class Ctx:
    device: str
    dry_run: bool
    work: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def checkpoint(ctx: Ctx, shape: str) -> str:
    """The HF checkpoint of ``shape`` (written once per run into ``ctx.work``; seeded)."""
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    kwargs = dict(SHAPES[shape])
    family = kwargs.pop("family")
    final = ctx.work / f"ckpt-{shape}"
    if not final.exists():  # written aside and renamed: a case killed mid-write leaves no half checkpoint
        tmp = ctx.work / f".ckpt-{shape}-{os.getpid()}"
        make_tiny_hf_checkpoint(tmp, family, **kwargs)
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its copy first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_process_world(cuda: bool):
    """torch.distributed of one rank (the backends need it): NCCL for CUDA tensors, gloo for CPU."""
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        try:
            from megatron.core import parallel_state as mpu

            if mpu.model_parallel_is_initialized():
                mpu.destroy_model_parallel()
        except ImportError:
            pass
        dist.destroy_process_group()


def step_batch(vocab: int, *, samples: int, prompt: int, response: int, seed: int = 0):
    """``(StepBatch, num_groups)``: ``samples`` samples in groups of 4, lengths drawn in
    ``[prompt/2, prompt]`` and ``[response/2, response]``, ids from 1 (id 0 is padding), a seeded
    loss mask with some masked tokens and per-group advantages."""
    from rl_plugin.loss import StepBatch

    g = torch.Generator().manual_seed(seed)
    p = torch.randint(max(1, prompt // 2), prompt + 1, (samples,), generator=g)
    r = torch.randint(max(1, response // 2), response + 1, (samples,), generator=g)
    total = p + r
    n_resp = int(r.sum())
    batch = StepBatch(
        tokens=torch.randint(1, vocab, (int(total.sum()),), generator=g),
        total_lengths=total,
        response_lengths=r,
        loss_mask=(torch.rand(n_resp, generator=g) > 0.1).float(),
        advantages=torch.randn(samples, generator=g).repeat_interleave(r),
        group_ids=torch.arange(samples) // 4,
    )
    return batch.validate(), (samples + 3) // 4


def train_flags(backend: str, hf_dir: str, *, bf16: bool, extra=()) -> list:
    flags = ["--train-backend", backend, "--hf-checkpoint", hf_dir, "--actor-num-gpus-per-node", "1"]
    flags += ["--optimizer", "sgd", "--lr", "1e-3", "--clip-grad", "0", "--micro-batch-size", "4"]
    # an entropy bonus makes J depend on the model (the on-policy PPO term alone is -mean(A))
    flags += ["--entropy-coef", "0.01"]
    return flags + (["--bf16"] if bf16 else []) + list(extra)


def make_backend(flags):
    from rl_plugin.arguments import parse_args

    args = parse_args(flags)
    if args.train_backend == "megatron":
        from rl_plugin.backends.megatron.backend import MegatronBackend as Backend
    else:
        from rl_plugin.backends.fsdp.backend import FSDPBackend as Backend
    return Backend.from_args(args)


def synchronize(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def timed(ctx: Ctx, fn, *, repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeat`` calls after ``warmup`` (device synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        synchronize(ctx)
        t0 = time.perf_counter()
        fn()
        synchronize(ctx)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def peak_flops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def close(name: str, got: float, want: float, *, rtol: float, atol: float = 0.0) -> Dict:
    """One numeric check: ``|got - want| <= atol + rtol * |want|``."""
    ok = abs(got - want) <= atol + rtol * abs(want)
    return dict(check=name, got=float(got), want=float(want), rtol=rtol, atol=atol, ok=bool(ok))


def run_child(module_fn: str, ctx: Ctx, out: Path, *, hide_cuda: bool, timeout: float, args: Optional[dict] = None):
    """Run ``module:function(ctx, out, **args)`` in a fresh Python (``hide_cuda``: with no visible
    GPU, so the backends take their CPU path: the fp32 reference) and return what it wrote.
    Under ``check --in-process`` (``IN_PROCESS_ENV`` set; the CPU dry run) it runs right here."""
    if os.environ.get(IN_PROCESS_ENV) and not (hide_cuda and torch.cuda.is_available()):
        import importlib

        module, fn = module_fn.split(":")
        getattr(importlib.import_module(module), fn)(ctx, out, **(args or {}))
        return torch.load(out, weights_only=False)
    env = dict(os.environ)
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    spec = json.dumps(
        dict(
            fn=module_fn,
            device="cpu" if hide_cuda else ctx.device,
            dry_run=ctx.dry_run,
            work=str(ctx.work),
            out=str(out),
            args=args or {},
        )
    )
    code = "import json, sys; from tests.gpu.common import child_main; child_main(json.loads(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, spec], cwd=ROOT, env=env, check=True, timeout=timeout)
    return torch.load(out, weights_only=False)


def child_main(spec: dict) -> None:
    import importlib

    from tests.gpu.check import install_import_block

    install_import_block()
    module, fn = spec["fn"].split(":")
    ctx = Ctx(spec["device"], spec["dry_run"], Path(spec["work"]))
    getattr(importlib.import_module(module), fn)(ctx, Path(spec["out"]), **spec["args"])
