"""GPU check cases of the trainers: each backend's bf16 step on the device against the CPU fp32
reference, and the train step's tokens/s and MFU on real model shapes.

Parity (``fsdp_parity``, ``megatron_parity``): one step on a seeded batch of the "parity" model
(random Qwen2, 4 layers, vocab 1024). The reference is the FSDP backend in fp32 on the CPU, run in
a fresh process with no visible GPU (``reference_step``, cached per run): J (the step's loss), the
per-token log-probs of a forward-only pass, the gradient norm and (FSDP) every parameter's
gradient, read just before the optimizer applies it. The flags add an entropy bonus
(``--entropy-coef 0.01``): the on-policy PPO term alone is ``-mean(A)`` whatever the model. Tolerances are bf16's: its unit roundoff is
``EPS = 2**-8``; the errors of a bf16 forward/backward through a few layers are a small multiple
of it relative to the compared quantity (``BF16``), and per-token log-probs (of magnitude
log V ~ 7) are compared in absolute terms.

Megatron runs the local layer spec (no transformer-engine on the loaned machine): thd attention
through ``compat.local_attention`` with the fused masked softmax off (issue 37 item 7: with it on,
the packed samples would attend to each other and the log-probs would be off by far more than bf16).

Timing (``throughput_fsdp`` / ``throughput_megatron``): SmolLM2-135M-shaped and Qwen2-0.5B-shaped
models (random weights), bf16, 16 samples of up to 512 + 512 tokens; the median of 3 steps after one
warm-up. ``tokens/s`` counts every token of the batch; MFU = model FLOPs / time / the GPU's dense bf16
peak, with model FLOPs = 6 N T (N: parameters, tied embedding once; T: tokens) + 6 L H sum(len^2)
(causal attention scores and weighted sums, forward and backward).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict

import torch

from tests.gpu.common import (
    SHAPES,
    Ctx,
    checkpoint,
    close,
    make_backend,
    one_process_world,
    peak_flops,
    run_child,
    step_batch,
    synchronize,
    train_flags,
)

EPS = 2.0**-8  # bf16 unit roundoff
# J and the gradient norm: sums over many tokens, a few EPS relative; all gradients together 8 EPS,
# the worst single tensor 32 EPS (seen on the CPU in bf16: ~15 EPS for a k_proj bias); log-probs
# (magnitude log V ~ 7) up to 12 EPS mean, 128 EPS max
BF16 = dict(
    loss_rtol=8 * EPS, norm_rtol=8 * EPS, grad_rel=8 * EPS, grad_worst=32 * EPS, logp_mean=12 * EPS, logp_max=128 * EPS
)


def _parity_batch(ctx: Ctx):
    shape = SHAPES["tiny" if ctx.dry_run else "parity"]
    return step_batch(
        shape["vocab_size"], samples=8, prompt=8 if ctx.dry_run else 64, response=8 if ctx.dry_run else 64
    )


def _parity_checkpoint(ctx: Ctx) -> str:
    return checkpoint(ctx, "tiny" if ctx.dry_run else "parity")


def _capture_grads(backend) -> Dict[str, torch.Tensor]:
    """Wrap ``backend.optimizer_step`` to keep each parameter's gradient (fp32, CPU) just before
    the optimizer applies it (FSDP: full tensors, HF names)."""
    grads: Dict[str, torch.Tensor] = {}
    step = backend.optimizer_step

    def optimizer_step():
        for name, p in backend.model.named_parameters():
            g = p.grad
            if g is not None:
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                grads[name] = g.detach().float().cpu()
        return step()

    backend.optimizer_step = optimizer_step
    return grads


def _capture_megatron_grads(backend) -> Dict[str, torch.Tensor]:
    """The Megatron backend's gradients under HF names, just before the optimizer applies them:
    each parameter's fp32 ``main_grad`` (DDP's buffer) is put in place of its weights for one
    export (``export_hf_state_dict``: mbridge's name map and q/k/v, gate/up splits, all linear, so
    the export of the gradients is the gradient of the export), then the weights are put back."""
    grads: Dict[str, torch.Tensor] = {}
    step = backend.optimizer_step

    def optimizer_step():
        params = [p for p in backend.model.parameters() if getattr(p, "main_grad", None) is not None]
        saved = [p.data for p in params]
        try:
            for p in params:
                p.data = p.main_grad.to(p.dtype)
            grads.update({k: v.float() for k, v in backend.export_hf_state_dict().items()})
        finally:
            for p, data in zip(params, saved):
                p.data = data
        return step()

    backend.optimizer_step = optimizer_step
    return grads


def _one_step(ctx: Ctx, backend_name: str, *, bf16: bool) -> dict:
    batch, groups = _parity_batch(ctx)
    with one_process_world(ctx.cuda):
        backend = make_backend(train_flags(backend_name, _parity_checkpoint(ctx), bf16=bf16))
        grads = _capture_grads(backend) if backend_name == "fsdp" else _capture_megatron_grads(backend)
        logp = backend.compute_log_probs(batch).float().cpu()
        report = backend.train_step(batch, num_groups=groups)
        synchronize(ctx)
    return dict(J=float(report["loss"]), grad_norm=float(report["grad_norm"]), logp=logp, grads=grads)


def reference_step(ctx: Ctx, out: Path) -> None:
    """The CPU fp32 reference (runs in a process with no visible GPU)."""
    torch.save(_one_step(ctx, "fsdp", bf16=False), out)


def _reference(ctx: Ctx) -> dict:
    path = ctx.work / "reference_step.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    return run_child("tests.gpu.cases_train:reference_step", ctx, path, hide_cuda=True, timeout=80)


def _compare(dev: dict, ref: dict) -> list:
    checks = [
        close("J", dev["J"], ref["J"], rtol=BF16["loss_rtol"], atol=1e-4),
        close("grad_norm", dev["grad_norm"], ref["grad_norm"], rtol=BF16["norm_rtol"]),
    ]
    diff = (dev["logp"] - ref["logp"]).abs()
    checks.append(close("logp mean |diff|", float(diff.mean()), 0.0, rtol=0.0, atol=BF16["logp_mean"]))
    checks.append(close("logp max |diff|", float(diff.max()), 0.0, rtol=0.0, atol=BF16["logp_max"]))
    if dev["grads"]:
        missing = sorted(set(ref["grads"]) - set(dev["grads"]))
        checks.append(dict(check="every reference gradient compared", got=missing, want=[], ok=not missing))
        worst, worst_name, err2, ref2 = 0.0, None, 0.0, 0.0
        for name, g in ref["grads"].items():
            if name in dev["grads"]:
                e = float((dev["grads"][name] - g).norm())
                err2, ref2 = err2 + e**2, ref2 + float(g.norm()) ** 2
                rel = e / max(float(g.norm()), 1e-12)
                if rel > worst:
                    worst, worst_name = rel, name
        total = (err2 / max(ref2, 1e-24)) ** 0.5
        checks.append(close("all gradients rel. L2 error", total, 0.0, rtol=0.0, atol=BF16["grad_rel"]))
        # one tensor (a bias: a sum over tokens with cancellation) is the least well-conditioned
        checks.append(
            close(f"worst tensor rel. L2 error ({worst_name})", worst, 0.0, rtol=0.0, atol=BF16["grad_worst"])
        )
    return checks


def fsdp_parity(ctx: Ctx) -> dict:
    ref = _reference(ctx)
    dev = _one_step(ctx, "fsdp", bf16=True)
    checks = _compare(dev, ref)
    return dict(ok=all(c["ok"] for c in checks), checks=checks, device=ctx.device)


def megatron_parity(ctx: Ctx) -> dict:
    ref = _reference(ctx)
    dev = _one_step(ctx, "megatron", bf16=True)
    checks = _compare(dev, ref)
    from rl_plugin.backends.megatron.compat import cpu_shim

    return dict(
        ok=all(c["ok"] for c in checks),
        checks=checks,
        device=ctx.device,
        shim_patches=cpu_shim.APPLIED,
        masked_softmax_fusion_off="masked_softmax_fusion" in cpu_shim.cpu_config_overrides(),
    )


def _flops(batch, hf_config, n_params: int) -> float:
    lengths = batch.total_lengths.double()
    layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    return 6.0 * n_params * float(lengths.sum()) + 6.0 * layers * hidden * float((lengths**2).sum())


def throughput_shape(ctx: Ctx, out: Path, backend_name: str, shape: str) -> None:
    """One shape's timed steps (a child process per shape: a fresh CUDA context and a fresh
    megatron-core parallel state each time)."""
    import time

    from transformers import AutoConfig

    steps = 1 if ctx.dry_run else 3
    hf_dir = checkpoint(ctx, shape)
    hf = AutoConfig.from_pretrained(hf_dir)
    small = ctx.dry_run
    batch, groups = step_batch(
        hf.vocab_size, samples=4 if small else 16, prompt=8 if small else 512, response=8 if small else 512
    )
    with one_process_world(ctx.cuda):
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        backend = make_backend(train_flags(backend_name, hf_dir, bf16=True))
        backend.train_step(batch, num_groups=groups)  # warm-up
        times = []
        for _ in range(steps):
            synchronize(ctx)
            t0 = time.perf_counter()
            backend.train_step(batch, num_groups=groups)
            synchronize(ctx)
            times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    n_params = hf_num_params(hf)
    flops = _flops(batch, hf, n_params)
    peak = peak_flops()
    torch.save(
        dict(
            params=n_params,
            tokens=int(batch.total_lengths.sum()),
            step_s=step_s,
            tokens_per_s=int(batch.total_lengths.sum()) / step_s,
            model_tflops_per_s=flops / step_s / 1e12,
            mfu=None if peak is None else flops / step_s / peak,
            peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if ctx.cuda else None,
        ),
        out,
    )


def _throughput(ctx: Ctx, backend_name: str) -> dict:
    rows, errors = {}, {}
    for shape in ["tiny"] if ctx.dry_run else ["smollm2-135m", "qwen2-0.5b"]:
        out = ctx.work / f"throughput-{backend_name}-{shape}.pt"
        try:
            rows[shape] = run_child(
                "tests.gpu.cases_train:throughput_shape",
                ctx,
                out,
                hide_cuda=False,
                timeout=120 if ctx.dry_run else 75,
                args=dict(backend_name=backend_name, shape=shape),
            )
        except Exception as e:  # noqa: BLE001 - one shape's failure (e.g. out of time) leaves the other's numbers
            errors[shape] = f"{type(e).__name__}: {e}"
    ok = not errors and all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in rows.values())
    name = torch.cuda.get_device_name() if ctx.cuda else "cpu"
    return dict(ok=ok, shapes=rows, errors=errors, peak_bf16_flops=peak_flops(), device_name=name)


def hf_num_params(hf_config) -> int:
    """Parameters of a dense HF decoder config (tied embedding counted once)."""
    h, inter, layers, vocab = (
        hf_config.hidden_size,
        hf_config.intermediate_size,
        hf_config.num_hidden_layers,
        hf_config.vocab_size,
    )
    heads, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    if getattr(hf_config, "attention_bias", False) or hf_config.model_type == "qwen2":
        attn += heads * head_dim + 2 * kv * head_dim
    per_layer = attn + 3 * h * inter + 2 * h
    emb = vocab * h * (1 if hf_config.tie_word_embeddings else 2)
    return layers * per_layer + emb + h


def throughput_fsdp(ctx: Ctx) -> dict:
    return _throughput(ctx, "fsdp")


def throughput_megatron(ctx: Ctx) -> dict:
    return _throughput(ctx, "megatron")
