"""Tiny random mixture-of-experts configs (Qwen3-MoE, Qwen2-MoE, Mixtral) for ``tiny.tiny_config``.

Each is the real architecture shrunk: 4 routed experts, top-2, every layer sparse
(``decoder_sparse_step`` 1, no ``mlp_only_layers``), head_dim 32 (vLLM's CPU attention takes
head sizes from 32 up). Router scoring as the released models have it:

- ``qwen3_moe``: softmax over all experts, top-k, renormalised (``norm_topk_prob`` True), q/k norm;
- ``qwen2_moe``: softmax, top-k, not renormalised; a shared expert with a sigmoid gate; q/k/v bias;
- ``mixtral``: top-k of the logits, softmax over the k (the same as renormalised softmax).

``router_aux_loss_coef`` is the HF config's; the trainers take their own coefficients from flags
(``--moe-aux-loss-coeff``), so it only describes the checkpoint.
"""

from __future__ import annotations

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_moe_config(
    family: str,
    common: dict,
    *,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    head_dim: int | None = None,
    norm_topk_prob: bool | None = None,
):
    """The HF config of MoE ``family`` from ``tiny_config``'s shared ``common`` sizes (its
    ``intermediate_size`` is the shared expert's in Qwen2-MoE, unused by the others).
    ``norm_topk_prob``: the Qwen families' renormalisation of the top-k weights (default: as the
    released models, module docstring); Mixtral always renormalises and refuses it."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if head_dim is not None and head_dim * heads != hidden and family != "mixtral":
        raise ValueError(f"{family}: head_dim {head_dim} must equal hidden_size {hidden} / num_heads {heads}")
    sparse = dict(num_experts_per_tok=top_k, router_aux_loss_coef=0.01, output_router_logits=False)
    if norm_topk_prob is not None and family == "mixtral":
        raise ValueError("mixtral has no norm_topk_prob: its top-k weights are always renormalised")
    norm = {"qwen3_moe": True, "qwen2_moe": False}.get(family) if norm_topk_prob is None else bool(norm_topk_prob)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, **sparse, rope_parameters=rope, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
        )  # fmt: skip
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, **sparse, rope_parameters=rope, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=common["intermediate_size"], norm_topk_prob=norm, decoder_sparse_step=1,
            mlp_only_layers=[], qkv_bias=True,
        )  # fmt: skip
    if family == "mixtral":
        common = {**common, "intermediate_size": moe_intermediate_size}
        return MixtralConfig(
            **common, **sparse, rope_parameters=rope, num_local_experts=num_experts, head_dim=head_dim or hidden // heads,
            sliding_window=None, router_jitter_noise=0.0,
        )  # fmt: skip
    raise ValueError(f"unknown tiny MoE family {family!r}; choose from {MOE_FAMILIES}")


# head_dim 32 (vLLM's CPU attention), 4 heads / 2 KV heads (TP 2 splits both)
MOE_SIZES = dict(hidden_size=128, num_heads=4, num_kv_heads=2)
