"""GPU check case: the loss core's fused head (``fused_log_probs_and_entropy``: hidden rows and the
output weight in, log-probs and entropy out, the ``[n, V]`` logits never built) against the
unfused path (``hidden @ W^T`` then ``log_probs_and_entropy``) on the device, bf16, Qwen2-0.5B's
head (H 896, V 151936) and 8192 response rows: forward + backward of ``sum(logp + entropy)``.

Reports the peak memory above the inputs of each path and its median time, and checks that both
give the same log-probs, entropies and gradients to bf16's tolerance (the unfused path's logits are
bf16; the fused head accumulates each vocab chunk in fp32, so it is the more exact of the two).
"""

from __future__ import annotations

import torch

from tests.gpu.common import Ctx, close, synchronize, timed

EPS = 2.0**-8


def _paths(hidden, weight, targets, device):
    from rl_plugin.loss import default_chunk_rows, fused_log_probs_and_entropy, log_probs_and_entropy

    def unfused():
        logits = hidden @ weight.t()
        return log_probs_and_entropy(logits, targets, chunk_size=1024)

    def fused():
        chunk = default_chunk_rows(weight.shape[0], device=device)
        return fused_log_probs_and_entropy(hidden, weight, targets, chunk_size=chunk)

    return {"unfused": unfused, "fused": fused}


def fused_head(ctx: Ctx) -> dict:
    rows, h, v = (64, 32, 1000) if ctx.dry_run else (8192, 896, 151936)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(rows, h, generator=g).to(ctx.device, dtype)
    weight0 = (torch.randn(v, h, generator=g) / h**0.5).to(ctx.device, dtype)
    targets = torch.randint(0, v, (rows,), generator=g).to(ctx.device)
    out, stats = {}, {}
    for name in ("unfused", "fused"):
        hidden = hidden0.clone().requires_grad_(True)
        weight = weight0.clone().requires_grad_(True)
        fn = _paths(hidden, weight, targets, ctx.device)[name]

        def run(fn=fn, hidden=hidden, weight=weight):
            hidden.grad = weight.grad = None
            logp, ent = fn()
            (logp.sum() + ent.sum()).backward()
            return logp, ent

        synchronize(ctx)
        if ctx.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        logp, ent = run()
        synchronize(ctx)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if ctx.cuda else None
        seconds = timed(ctx, run, repeat=1 if ctx.dry_run else 5, warmup=0)
        out[name] = (logp.detach().float(), ent.detach().float(), hidden.grad.float(), weight.grad.float())
        stats[name] = dict(peak_mib_above_inputs=peak, seconds=seconds)
    (lu, eu, hu, wu), (lf, ef, hf, wf) = out["unfused"], out["fused"]
    logits_mib = rows * v * (2 if ctx.cuda else 4) / 2**20
    checks = [
        close("logp max |diff|", float((lu - lf).abs().max()), 0.0, rtol=0.0, atol=64 * EPS),
        close("entropy max |diff|", float((eu - ef).abs().max()), 0.0, rtol=0.0, atol=64 * EPS),
        close("d hidden rel. L2", float((hu - hf).norm() / hu.norm()), 0.0, rtol=0.0, atol=8 * EPS),
        close("d weight rel. L2", float((wu - wf).norm() / wu.norm()), 0.0, rtol=0.0, atol=8 * EPS),
    ]
    if ctx.cuda:
        # the fused head never holds a [rows, V] block: its peak stays below one bf16 logits copy
        peak = stats["fused"]["peak_mib_above_inputs"]
        checks.append(
            dict(check="fused peak (MiB) below one logits copy", got=peak, want=logits_mib, ok=peak < logits_mib)
        )
    speed = stats["unfused"]["seconds"] / stats["fused"]["seconds"]
    return dict(
        ok=all(c["ok"] for c in checks),
        checks=checks,
        paths=stats,
        logits_mib=logits_mib,
        fused_speedup=speed,
        shape=dict(rows=rows, hidden=h, vocab=v, dtype=str(dtype)),
    )
