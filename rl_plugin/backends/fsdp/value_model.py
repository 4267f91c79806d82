"""The FSDP backend's value model (``TrainConfig.value_head``: the critic of PPO with a critic).

The model is the Hugging Face ``<Family>ForTokenClassification`` with one label
(``rl_plugin.models.value_head``; ``model.load_hf_model(..., value_head=True)``): the causal LM's
backbone and a bias-free scalar head ``score`` ``[1, hidden]`` in place of the LM head, sharded
like the policy (``model.shard_model``), with its own AdamW and LR schedule, no reference model,
no fused or fp32 LM head and no LoRA (the critic trains all its weights).

Its forward runs the micro-batch through the SAME packed inputs as the log-probs
(``packing.model_inputs``: the padded grid or the one row with its block-diagonal mask, or bshd)
and reads the head's output at the rows that predict the response tokens, in
``layout.logit_index`` order: V(s_t) for response token t is the head on the hidden state whose
logits would give t's log-prob. The head is one dot product per position, so it runs on every
position and the rows are selected after it (``logits_to_keep`` is a causal-LM argument).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_plugin.backends.fsdp.packing import model_inputs


def micro_batch_values(
    model, mb, attn_implementation: str, device: torch.device, padded_grid: Optional[bool] = None
) -> torch.Tensor:
    """``[n_local, 1]`` fp32 values of one micro-batch's local response tokens (module docstring);
    ``padded_grid`` as ``packing.model_inputs``'s (thd's form; default: the cheaper one)."""
    kwargs, row_index = model_inputs(mb, attn_implementation, device, padded_grid)
    keep = kwargs.pop("logits_to_keep", None)  # thd as one row: the kept positions are the rows
    rows = row_index if row_index is not None else keep
    scores = model(**kwargs).logits  # [S, L, 1] (or [1, t, 1])
    return scores.reshape(-1)[rows].float().unsqueeze(1)


def idle_values(model, device: torch.device) -> torch.Tensor:
    """An idle pass (a rank with no sample joins FSDP's collectives): one token through the
    model, ``[0, 1]`` carrying its graph times 0 so the backward joins them too."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    return (model(input_ids=ids, use_cache=False).logits.float().sum() * 0.0).expand(0, 1)
