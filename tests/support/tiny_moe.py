"""A tiny seeded Qwen3-MoE checkpoint for the routing-replay tests (4 experts, top-2, 2 layers),
until ``rl_plugin.models.tiny`` makes MoE families (issue 25's MoE half)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_qwen3_moe(path, *, seed: int = 0, num_experts: int = 4, top_k: int = 2) -> Path:
    """Write the checkpoint to ``path`` (once; idempotent) and return it."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        router_aux_loss_coef=0.0,
    )
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path
