"""A tiny Hugging Face causal LM, written once as an HF checkpoint directory both backends load.

Used by the embedded default run and the tests: real Qwen2 / Llama / Qwen3 (q/k norm) / Mistral /
Gemma architectures, shrunk so a CPU trains them in seconds (``tests/fast/backends/test_model_families``
runs each through both backends and both engines). Weights are drawn from a seeded generator, so the same arguments give
bit-identical checkpoints on every machine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_plugin.models.tiny_moe import MOE_FAMILIES, MOE_SIZES, tiny_moe_config

DENSE_FAMILIES = ("qwen2", "llama", "qwen3", "mistral", "gemma")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


def tiny_config(
    family: str = "qwen2",
    *,
    vocab_size: int = 128,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    **moe_kwargs,
):
    """An HF config of ``family``; ``head_dim`` defaults to ``hidden_size // num_heads`` (Qwen3,
    Mistral and Gemma carry it explicitly, with large defaults). Mistral without a sliding window
    (as Mistral 7B v0.2+), Gemma 1 (scaled embedding, (1 + w) RMSNorm, GeGLU; tied by design,
    here as ``tie_word_embeddings`` says). The MoE families (``tiny_moe``) take ``moe_kwargs``
    (``num_experts``, ``top_k``, ``moe_intermediate_size``, ``norm_topk_prob``)."""
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family in MOE_FAMILIES:
        return tiny_moe_config(family, common, head_dim=head_dim, **moe_kwargs)
    if moe_kwargs:
        raise ValueError(f"{family} is a dense family: {sorted(moe_kwargs)} apply to {MOE_FAMILIES}")
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0)
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    head_dim = head_dim or hidden_size // num_heads
    if family == "qwen3":
        return Qwen3Config(**common, rope_theta=10000.0, head_dim=head_dim, attention_bias=False)
    if family == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, head_dim=head_dim, sliding_window=None)
    if family == "gemma":
        return GemmaConfig(**common, rope_theta=10000.0, head_dim=head_dim, hidden_act="gelu_pytorch_tanh")
    raise ValueError(f"unknown tiny model family {family!r}; choose from {FAMILIES}")


def make_tiny_hf_checkpoint(path, family: str = "qwen2", *, seed: int = 0, **config_kwargs) -> Path:
    """Write a seeded tiny model to ``path`` (safetensors + config.json) and return the path.

    Idempotent: an existing checkpoint with the same config is left as it is.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_config(family, **config_kwargs)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def default_tiny_checkpoint() -> str:
    """The checkpoint a backend falls back to without ``--hf-checkpoint``: a tiny Qwen2 under
    ``~/.cache/rl_plugin/tiny-qwen2``, written once by rank 0 while the other ranks wait, so every
    backend and rank starts from the same weights. (The loop's embedded default passes its own
    ``--hf-checkpoint``, see ``rl_plugin.loop.embedded_setup``.)"""
    import torch.distributed as dist

    path = Path.home() / ".cache" / "rl_plugin" / "tiny-qwen2"
    initialized = dist.is_available() and dist.is_initialized()
    if not initialized or dist.get_rank() == 0:
        make_tiny_hf_checkpoint(path, "qwen2")
    if initialized:
        dist.barrier()
    return str(path)


def make_tiny_moe_checkpoint(path, family: str = "qwen3_moe", *, seed: int = 0, **config_kwargs):
    """``make_tiny_hf_checkpoint`` of an MoE family at ``MOE_SIZES`` (overridable)."""
    return make_tiny_hf_checkpoint(path, family, seed=seed, **{**MOE_SIZES, **config_kwargs})
