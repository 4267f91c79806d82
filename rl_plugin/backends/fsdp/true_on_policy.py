"""True on-policy mode on the FSDP backend (``TrainConfig.true_on_policy``, issue 45).

The HF model is patched by ``rl_plugin.invariant.make_invariant`` before ``fully_shard`` (no fused
or fp32 LM head: the head is the invariant linear), and a micro-batch's log-probs are

    logp = invariant.log_softmax(logits_rows / T)[row, target]
    entropy = -sum_v exp(logp_v) logp_v          (not bitwise-critical; zeros when not asked)

from the response rows' logits (``packing.micro_batch_logits``: packed thd, padded grid or bshd
alike, every form gives a token the same bits): the very op and inputs the hf engine sampled
with, so ``compute_log_probs`` equals the rollout's log-probs bitwise.
"""

from __future__ import annotations

import torch

from rl_plugin import invariant
from rl_plugin.backends.fsdp.packing import micro_batch_logits


def invariant_log_probs(model, mb, options, attn_implementation: str, device: torch.device):
    """``(logp, entropy)`` ``[n_local]`` aligned with ``mb.targets`` (module docstring)."""
    rows = micro_batch_logits(model, mb, attn_implementation, device)
    logp = invariant.log_softmax(rows, options.temperature)
    chosen = logp.gather(1, mb.targets.to(device)[:, None]).squeeze(1)
    if not options.with_entropy:
        return chosen, torch.zeros_like(chosen)
    return chosen, -(logp.exp() * logp).sum(-1)
