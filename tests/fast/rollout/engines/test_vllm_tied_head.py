"""Issue 22 finding, pinned: with tied embeddings (SmolLM2, Llama-3.2, Qwen2.5-0.5B...) vLLM's CPU
build packs the LM head into a GEMM handle once at load, and ``reload_weights`` does not refresh
it: after a weight sync the engine sampled with the new embedding and the old head (trainer /
engine mismatch 1e-5 -> 4e-3 on SmolLM2) while ``--check-weight-sync`` passed, because the
read-back took the tied head to be the embedding. ``VLLMEngine.update_weights`` now repacks a tied
head, and the read-back reads the head through its own kernel.

A tiny tied Llama with SmolLM2's vocabulary size (49,152 rows: the head takes the packed GEMM
path a tiny vocabulary would not) gets a perturbed embedding; then the engine's log-probs must
match a Hugging Face forward of the tied model with that embedding (the bound of
``rollout/engines/test_engines``), and the head read back must equal the embedding sent, bitwise.
"""

import importlib.util

import pytest
import torch

from rl_plugin.models.tiny import make_tiny_hf_checkpoint
from tests.fast.rollout.engines.test_engines import MAX_BOUND, _spawned

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
VOCAB = 49152


def _worker(ckpt: str) -> dict:
    from safetensors.torch import load_file

    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.vllm_engine import VLLMEngine

    emb = load_file(f"{ckpt}/model.safetensors")["model.embed_tokens.weight"]
    new = emb * (1 + 0.5 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
    eng = VLLMEngine(ckpt, device="cpu", max_model_len=64)
    eng.update_weights({"model.embed_tokens.weight": new})
    gens = eng.generate([[1, 5, 9, 300, 4000], [1, 7, 7, 49000]], SamplingParams(1.0, 1.0, 6), seed=3)
    return {"new": new, "gens": gens, "head": eng.weights()["lm_head.weight"]}


def test_tied_head_follows_the_embedding_after_a_sync(tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny_hf_checkpoint(
        tmp_path / "tied",
        "llama",
        vocab_size=VOCAB,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    out = _spawned(_worker, str(ckpt))
    assert torch.equal(out["head"], out["new"])  # read through the head's kernel, not assumed
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(out["new"])  # tied: the head follows
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        errs = []
        for g in out["gens"]:
            ids = torch.tensor([g.prompt_ids + g.response_ids])
            n = len(g.prompt_ids)
            ref = torch.log_softmax(model(ids).logits[0, n - 1 : -1], -1).gather(-1, ids[0, n:, None]).squeeze(-1)
            errs.append((torch.tensor(g.log_probs) - ref).abs().max())
    assert float(max(errs)) < MAX_BOUND, [float(e) for e in errs]
