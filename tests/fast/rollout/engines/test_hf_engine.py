"""The hf engine (``rl_plugin.rollout.engines.hf_engine``): its log-probs are the model's, its weight
sync refuses names it does not hold, and it stops at every eos id of the generation config."""

import pytest
import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.engines.base import SamplingParams, make_engine
from tests.support.tolerance import FP32_MODEL, tensor_within


def test_hf_engine_log_probs_match_the_model(tmp_path):
    """The sampler's per-token log-probs equal log_softmax(logits / T) of a fresh forward pass."""
    from transformers import AutoModelForCausalLM

    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    torch.set_num_threads(1)
    ck = make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64)
    eng = make_engine(EngineConfig(engine="hf"), str(ck))
    prompts = [[1, 5, 6, 3], [1, 7, 3], [1, 5, 6, 3]]
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=5)
    gens = eng.generate(prompts, params, seed=11)
    again = eng.generate(prompts, params, seed=11)
    assert [g.response_ids for g in gens] == [g.response_ids for g in again]  # seeded
    model = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32).eval()
    for g in gens:
        assert 1 <= len(g.response_ids) <= 5 and len(g.log_probs) == len(g.response_ids)
        assert g.finished == (g.response_ids[-1] == 2)
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = len(g.prompt_ids)
        ref = torch.log_softmax(logits[p - 1 : -1] / 0.7, -1).gather(-1, ids[0, p:, None]).squeeze(-1)
        # generate (KV cache, incremental) vs one full forward: fp32 rounding of |logp| + 1 terms
        assert tensor_within(torch.tensor(g.log_probs), ref, rtol=FP32_MODEL, scale=1.0)
    # weight sync: new weights change generation's distribution, and bad names are rejected
    sd = {k: v + 0.01 for k, v in eng.weights().items()}
    eng.update_weights(sd)
    assert torch.equal(eng.weights()["model.norm.weight"], sd["model.norm.weight"])
    with pytest.raises(ValueError, match="weight sync: the trainer's export does not match"):
        eng.update_weights({"bogus": torch.zeros(1)})


def test_hf_engine_stops_at_every_eos_id(tmp_path):
    """Regression: the HF engine stopped only on the first EOS id of the generation config. With
    ``eos_token_id: [2, X]`` a response ends at its first 2 or X (included, ``finished``), and is
    the prefix of what the same seed samples with ``[2]`` alone (sampling is unchanged up to it)."""
    import json
    import shutil

    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    torch.set_num_threads(1)
    ck = make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64)
    prompts = [[1, 5, 6, 3], [1, 7, 3], [1, 5, 6, 3], [1, 4, 4, 9]]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12)
    one = make_engine(EngineConfig(engine="hf"), str(ck)).generate(prompts, params, seed=5)
    # the second stop id: a token some response samples before any 2
    firsts = [t for g in one for t in g.response_ids[:-1] if t != 2]
    assert firsts, [g.response_ids for g in one]
    x = firsts[0]
    two_dir = tmp_path / "two"
    shutil.copytree(ck, two_dir)
    cfg = json.loads((two_dir / "generation_config.json").read_text())
    (two_dir / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [2, x]}))
    two = make_engine(EngineConfig(engine="hf"), str(two_dir)).generate(prompts, params, seed=5)
    stopped_at_x = 0
    for a, b in zip(one, two):
        stops = [k for k, t in enumerate(a.response_ids) if t in (2, x)]
        n = stops[0] + 1 if stops else len(a.response_ids)
        assert b.response_ids == a.response_ids[:n] and b.finished == bool(stops)
        assert b.log_probs == a.log_probs[:n]
        stopped_at_x += bool(stops) and b.response_ids[-1] == x
    assert stopped_at_x >= 1


def test_true_on_policy_engine_log_probs_are_the_invariant_ops_bits(tmp_path):
    """With ``true_on_policy`` the engine's log-probs are, bit for bit, the invariant log-softmax of
    one full-sequence forward of the patched model (prefill + KV-cache decode = full sequence); the
    weight sync still reaches the patched model; top-p < 1 is refused."""
    from transformers import AutoModelForCausalLM

    from rl_plugin import invariant
    from rl_plugin.invariant.hf_patch import is_invariant, make_invariant
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    ck = make_tiny_hf_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=True)
    eng = make_engine(EngineConfig(engine="hf", true_on_policy=True), str(ck))
    assert eng.true_on_policy and is_invariant(eng.model)
    prompts = [[1, 5, 6, 3], [1, 7, 3], [1, 5, 6, 3], [9] * 20]
    params = SamplingParams(temperature=0.6, max_new_tokens=40)
    eng.update_weights({k: v * 1.01 for k, v in eng.weights().items()})  # the sync reaches the patched modules
    model = make_invariant(AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32).eval())
    model.load_state_dict(eng.model.state_dict())
    for gen in eng.generate(prompts, params, seed=5):
        ids = torch.tensor([gen.prompt_ids + gen.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        p = len(gen.prompt_ids)
        ref = invariant.log_softmax(logits[p - 1 : -1], 0.6).gather(-1, ids[0, p:, None]).squeeze(-1)
        assert torch.equal(torch.tensor(gen.log_probs), ref)
    with pytest.raises(ValueError, match="--rollout-top-p 1.0"):
        eng.generate(prompts, SamplingParams(temperature=0.6, top_p=0.9), seed=5)
