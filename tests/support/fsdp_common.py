"""Shared pieces of the FSDP backend tests: the tiny checkpoint, one step's data, flag lists."""

from __future__ import annotations

import torch

from rl_plugin.loss import StepBatch

VOCAB = 128


def tiny_checkpoint(tmp_root, family: str = "qwen2", **kwargs) -> str:
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    name = family + "".join(f"_{k}{v}" for k, v in sorted(kwargs.items()))
    return str(make_tiny_hf_checkpoint(tmp_root / name, family, **kwargs))


def make_step(seed: int = 0, *, with_ref: bool = True) -> dict:
    """9 samples in 3 prompt groups of 3 (a DP=2 split 5/4 puts group 1 on both ranks); uneven
    lengths, one-token responses, a zero-length response and an all-masked sample."""
    g = torch.Generator().manual_seed(seed)
    n = 9
    groups = torch.arange(n) // 3
    prompt = torch.randint(2, 7, (n,), generator=g)
    resp = torch.randint(2, 9, (n,), generator=g)
    resp[1] = 1
    resp[5] = 1
    resp[7] = 0
    total = prompt + resp
    r = int(resp.sum())
    sid = torch.repeat_interleave(torch.arange(n), resp)
    mask = (torch.rand(r, generator=g) > 0.2).float()
    mask[sid == 3] = 0.0
    adv = torch.randn(n, generator=g)[sid]
    old = -torch.rand(r, generator=g) * 4 - 3.0  # around the tiny model's log-probs (~ -4.8)
    refp = old + 0.1 * torch.randn(r, generator=g)
    tokens = torch.randint(3, VOCAB, (int(total.sum()),), generator=g)
    return dict(
        tokens=tokens,
        total_lengths=total,
        response_lengths=resp,
        loss_mask=mask,
        advantages=adv,
        group_ids=groups,
        old_log_probs=old,
        ref_log_probs=refp if with_ref else None,
    )


def step_batch(step: dict) -> StepBatch:
    return StepBatch(**{k: v.clone() if v is not None else None for k, v in step.items()})


def fsdp_flags(ckpt: str, *extra: str) -> list:
    return ["--train-backend", "fsdp", "--hf-checkpoint", ckpt, "--lr", "1e-3", "--seed", "7", *extra]


def parse(flags):
    from rl_plugin.arguments import parse_args

    return parse_args(list(flags))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def alone_log_probs(model, batch) -> torch.Tensor:
    """Each sample alone, plain HF forward (no mask, no packing), log-probs of its response."""
    out, start = [], 0
    for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
        ids = batch.tokens[start : start + t]
        start += t
        if r == 0:
            continue
        logits = model(input_ids=ids.view(1, -1), use_cache=False).logits[0]
        rows = logits[t - r - 1 : t - 1]
        out.append(torch.log_softmax(rows.double(), -1).gather(1, ids[t - r :].view(-1, 1)).squeeze(1))
    return torch.cat(out)
