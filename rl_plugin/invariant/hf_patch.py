"""``make_invariant(model)``: an HF Llama (tied or untied head), Qwen2 (q/k/v bias), Qwen3 (q/k
norm) or Mistral causal LM computed through the batch-invariant ops of ``rl_plugin.invariant``.

In place, on the model's own modules (the parameters, their tying and their names stay; a module's
class becomes a subclass of its own class with the invariant ``forward``, so ``isinstance``,
``state_dict``, FSDP2's ``fully_shard`` and PEFT see the same model):

- every ``nn.Linear`` (the projections, the MLP, the LM head, tied or not; LoRA's A/B too) ->
  ``invariant.linear``;
- every ``*RMSNorm`` (the layer norms, the final norm, Qwen3's q/k norms) -> ``invariant.rms_norm``;
- the rotary embedding -> ``invariant.rope_cos_sin`` (static rope types only);
- every self-attention -> q/k/v projections, (Qwen3: q/k norm), ``invariant.apply_rope``, the
  KV cache update as HF does it, then ``invariant.attention`` with each query's keys taken from
  ``position_ids`` (query i of a row attends the keys ``[i' - p, i']`` of that row, i' its index
  among the row's keys, p its position): exactly the keys HF's causal, right-padding and packed
  (position-id reset) masks give a real token, so the mask itself is not read. Left padding
  (a real token after a pad) is not supported; neither are sliding windows or attention dropout.

The embedding is a gather (exact) and the activations are elementwise: they stay. Call it before
``fully_shard`` / ``.to(device)`` wrappers that swap classes themselves; calling it twice is a no-op.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_plugin import invariant as ops

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _linear_forward(self, x):
    return ops.linear(x, self.weight, self.bias)


def _norm_forward(self, x):
    return ops.rms_norm(x, self.weight, self.variance_epsilon)


def _rope_forward(self, x, position_ids):
    cos, sin = ops.rope_cos_sin(position_ids, self.inv_freq, self.attention_scaling)
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _attention_forward(
    self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs
):
    """The family's attention forward with the invariant ops (see the module docstring)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("make_invariant: the attention needs position_ids (the decoder layer passes them)")
    batch, queries = hidden_states.shape[:2]
    shape = (batch, queries, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape)
    k = self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over the head dim, before RoPE
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q = ops.apply_rope(q.transpose(1, 2), cos[:, None], sin[:, None])
    k = ops.apply_rope(k.transpose(1, 2), cos[:, None], sin[:, None])
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    keys = k.shape[2]
    pos = position_ids.expand(batch, queries).to(torch.long)
    index = (
        torch.arange(batch, device=pos.device)[:, None] * keys
        + (keys - queries)
        + torch.arange(queries, device=pos.device)
    )
    start = index - pos  # the index of the row's key at position 0
    if bool((start < torch.arange(batch, device=pos.device)[:, None] * keys).any()):
        raise ValueError("make_invariant: position_ids exceed the keys before them (left padding is not supported)")
    out = ops.attention(
        q.transpose(1, 2).reshape(batch * queries, -1, self.head_dim),
        k.transpose(1, 2).reshape(batch * keys, -1, self.head_dim),
        v.transpose(1, 2).reshape(batch * keys, -1, self.head_dim),
        start.reshape(-1),
        pos.reshape(-1),
        self.scaling,
    )
    return self.o_proj(out.reshape(batch, queries, -1)), None


def _swap(module: nn.Module, forward) -> None:
    """``module``'s class -> a subclass of it whose ``forward`` is ``forward`` (once)."""
    cls = type(module)
    if getattr(cls, "_rl_invariant", False):
        return
    module.__class__ = type(f"Invariant{cls.__name__}", (cls,), {"forward": forward, "_rl_invariant": True})


def unsupported(model) -> str | None:
    """Why ``make_invariant`` cannot patch ``model``, or None."""
    cfg = model.config.get_text_config(decoder=True)
    if cfg.model_type not in FAMILIES:
        return f"model type {cfg.model_type!r} (supported: {', '.join(FAMILIES)})"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={cfg.sliding_window})"
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention dropout {cfg.attention_dropout}"
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if hasattr(module, "inv_freq") and rope_type not in STATIC_ROPE:
            return f"rope type {rope_type!r} (static types only: {', '.join(STATIC_ROPE)})"
    return None


def make_invariant(model):
    """Patch ``model`` in place onto the invariant ops (see the module docstring); returns it.
    Raises ``ValueError`` naming what is unsupported."""
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(f"true on-policy mode cannot patch this model: {reason}")
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, nn.Linear):
            _swap(module, _linear_forward)
        elif name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            _swap(module, _norm_forward)
        elif name.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            _swap(module, _rope_forward)
        elif name.endswith("Attention") and hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            _swap(module, _attention_forward)
    model._rl_invariant = True
    return model


def is_invariant(model) -> bool:
    return bool(getattr(model, "_rl_invariant", False))
