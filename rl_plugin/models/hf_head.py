"""Whether a Hugging Face causal LM's logits are ``hidden @ lm_head.weight^T`` and nothing more,
so the fused log-prob head (``rl_plugin.loss.fused_log_probs_and_entropy``) can stand in for its
head: the FSDP backend's ``FusedLogProbHead`` and the engine-served OPD teacher (``--opd-type hf``)
ask the same question here."""

from __future__ import annotations

from typing import Optional

from torch import nn

# Config fields with which an HF model post-processes its logits after ``lm_head`` (Gemma-2 soft-
# capping, Cohere / Granite scaling): the fused head cannot stand in for those heads.
LOGIT_POSTPROCESS_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def fused_head_unsupported(model: nn.Module) -> Optional[str]:
    """Why the fused head cannot stand in for this HF model's head, or None."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return f"the output embedding is {type(head).__name__}, not nn.Linear"
    if head.bias is not None:
        return "the output layer has a bias"
    for field in LOGIT_POSTPROCESS_FIELDS:
        value = getattr(model.config, field, None)
        if value not in (None, 1, 1.0):
            return f"the model post-processes its logits (config.{field}={value})"
    return None
