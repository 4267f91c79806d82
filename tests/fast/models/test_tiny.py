"""The tiny checkpoints (``rl_plugin.models.tiny``): each family's config, bit-identical weights from
the same seed (a different seed differs), the idempotent write, and the refusals naming the family."""

from __future__ import annotations

import hashlib

import pytest
from safetensors.torch import load_file

from rl_plugin.models.tiny import DENSE_FAMILIES, FAMILIES, make_tiny_hf_checkpoint, tiny_config


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_dense_configs(family):
    cfg = tiny_config(family, hidden_size=48, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    assert cfg.model_type == family
    assert (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == (128, 48, 2, 4, 2)
    assert cfg.tie_word_embeddings and (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    if family in ("qwen3", "mistral", "gemma"):
        assert cfg.head_dim == 12  # explicit, not the family's large default
    if family == "mistral":
        assert cfg.sliding_window is None


def test_same_seed_same_bytes_and_idempotent(tmp_path):
    a = make_tiny_hf_checkpoint(tmp_path / "a", "qwen2", seed=3)
    b = make_tiny_hf_checkpoint(tmp_path / "b", "qwen2", seed=3)
    c = make_tiny_hf_checkpoint(tmp_path / "c", "qwen2", seed=4)
    assert _digest(a) == _digest(b) != _digest(c)
    before = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_hf_checkpoint(a, "qwen2", seed=99) == a  # an existing checkpoint is left as it is
    assert (a / "model.safetensors").stat().st_mtime_ns == before and _digest(a) == _digest(b)
    weights = load_file(str(a / "model.safetensors"))
    norms = [t for n, t in weights.items() if n.endswith("norm.weight")]
    assert norms and all(float((t - 1).abs().max()) < 1.0 for t in norms)  # 1 + 0.1 N(0, 1): around 1


def test_refusals_name_the_family():
    with pytest.raises(ValueError, match=r"unknown tiny model family 'gpt2'; choose from"):
        tiny_config("gpt2")
    with pytest.raises(ValueError, match=r"qwen2 is a dense family: \['num_experts'\] apply to"):
        tiny_config("qwen2", num_experts=4)
    assert set(DENSE_FAMILIES) < set(FAMILIES)
