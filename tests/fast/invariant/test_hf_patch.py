"""rl_plugin.invariant.hf_patch: a patched tiny Llama (tied / untied), Qwen2, Qwen3 and Mistral give
HF's logits to fp32, and the same bits for a token decoded against a KV cache, in a full-sequence
forward, alone or in a batch, packed with another document (position-id reset) or right-padded."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rl_plugin.invariant.hf_patch import is_invariant, make_invariant
from rl_plugin.models.tiny import tiny_config

CASES = [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False), ("mistral", False)]


def _models(family, tied):
    torch.manual_seed(0)
    cfg = tiny_config(family, tie_word_embeddings=tied)
    plain = AutoModelForCausalLM.from_config(cfg).eval()
    return cfg, plain, make_invariant(copy.deepcopy(plain))


@pytest.mark.parametrize("family,tied", CASES)
@torch.no_grad()
def test_patched_model_is_hf_to_fp32_and_invariant(family, tied):
    cfg, plain, inv = _models(family, tied)
    assert is_invariant(inv) and not is_invariant(plain)
    assert (inv.lm_head.weight is inv.model.embed_tokens.weight) == tied
    ids = torch.randint(0, cfg.vocab_size, (3, 90), generator=torch.Generator().manual_seed(1))
    full = inv(ids).logits
    torch.testing.assert_close(full, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(inv(ids[1:2]).logits[0], full[1])  # a row alone = the row in a batch
    # prefill 50 tokens, then decode one token at a time against the cache
    cache = DynamicCache(config=cfg)
    rows = [inv(ids[:2, :50], past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(50, 89):
        step = inv(ids[:2, t : t + 1], past_key_values=cache, use_cache=True, position_ids=torch.full((2, 1), t))
        rows.append(step.logits[:, -1])
    assert torch.equal(torch.stack(rows, 1), full[:2, 49:89])
    # packed: two documents in one row, positions reset at the second
    packed = torch.cat([ids[0, :30], ids[2, :60]])[None]
    positions = torch.cat([torch.arange(30), torch.arange(60)])[None]
    out = inv(packed, position_ids=positions).logits[0]
    assert torch.equal(out[:30], full[0, :30]) and torch.equal(out[30:], full[2, :60])
    # right padding with a 2-D mask: the real tokens keep their bits
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, 40:] = 0
    assert torch.equal(inv(ids[:2], attention_mask=mask).logits[1, :40], full[1, :40])


def test_unsupported_model_is_refused_with_the_reason():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma"))
    with pytest.raises(ValueError, match="model type 'gemma'"):
        make_invariant(model)
    sliding = AutoModelForCausalLM.from_config(
        tiny_config("mistral").__class__(**{**tiny_config("mistral").to_dict(), "sliding_window": 16})
    )
    with pytest.raises(ValueError, match="sliding_window=16"):
        make_invariant(sliding)
