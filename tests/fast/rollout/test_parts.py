"""Rollout pieces without Ray: tokenizer, task and rewards, JSONL dataset, engines."""

import json

import pytest
import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.data.dataset import PromptDataset, read_jsonl
from rl_plugin.rollout.data.task import digit_match_reward, make_task_records, write_task_data
from rl_plugin.rollout.data.tokenizer import CharTokenizer, load_tokenizer
from rl_plugin.rollout.engines.base import SamplingParams, make_engine
from rl_plugin.rollout.rewards.functions import REWARDS, extract_final_answer, load_reward_fn, score_responses
from tests.support.tolerance import FP32_MODEL, tensor_within


def test_char_tokenizer_round_trip(tmp_path):
    tok = CharTokenizer("0123456789")
    ids = tok.prompt_ids("314=")
    assert ids == [1, 7, 5, 8, 3]
    assert tok.decode([7, 5, 2, 9]) == "31"  # stops at <eos>
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).prompt_ids("314=") == ids
    with pytest.raises(ValueError, match=r"character 'x' at position 1 of '3x'"):
        tok.encode("3x")


def test_task_records_and_reward(tmp_path):
    recs = make_task_records(3, task="reverse", seed=1)
    assert all(r["label"] == r["prompt"][:-1][::-1] for r in recs)
    assert digit_match_reward("413", "413") == 1.0
    assert digit_match_reward("41", "413") == pytest.approx(2 / 3)
    assert digit_match_reward("4139", "413") == pytest.approx(3 / 4)  # extra characters cost credit
    assert digit_match_reward("", "413") == 0.0
    train, ev = write_task_data(tmp_path, num_train=50, num_eval=8, seed=0)
    tr = {json.loads(x)["prompt"] for x in train.read_text().splitlines()}
    evp = {json.loads(x)["prompt"] for x in ev.read_text().splitlines()}
    assert len(evp) == 8 and not tr & evp


def test_math_exact_and_custom_reward(tmp_path):
    fn = load_reward_fn("math_exact")
    assert fn("q", "so the answer is \\boxed{42}", "42") == 1.0
    assert fn("q", "it is 3, then 41.0", 41) == 1.0
    assert fn("q", "no number", "7") == 0.0
    assert extract_final_answer("a 1 b 2") == "2"
    (tmp_path / "rm.py").write_text("def rm(prompt, response, label):\n    return float(len(response))\n")
    custom = load_reward_fn(None, f"{tmp_path}/rm.py:rm")
    assert custom("p", "abc", None) == 3.0
    with pytest.raises(ValueError, match="--custom-rm-path 'no_such_mod:f': cannot load"):
        load_reward_fn(None, "no_such_mod:f")
    with pytest.raises(ValueError, match=r"--rm-type 'nope': unknown reward"):
        load_reward_fn("nope")
    with pytest.raises(ValueError, match=r"returned nan for sample 1 \(prompt 'b'"):
        score_responses(lambda p, r, _label: float("nan") if p == "b" else 0.0, ["a", "b"], ["", ""], [None, None])
    assert set(REWARDS) >= {"digit_match", "math_exact"}


def test_dataset_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "label": 1}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: no key 'prompt' \(--input-key\)"):
        read_jsonl(p, "prompt", "label")
    p.write_text('{"prompt": "a", "label": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        read_jsonl(p, "prompt", "label")
    p.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: no key 'label' \(--label-key\)"):
        read_jsonl(p, "prompt", "label")
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        read_jsonl(tmp_path / "missing.jsonl", "prompt", None)


def test_dataset_position_resumes_across_epochs(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"q": str(i)}) + "\n" for i in range(5)))
    ds = PromptDataset.from_jsonl(p, "q", None, shuffle=True, seed=3)
    ds.next_batch(4)
    state = ds.state_dict()
    expected = [r.prompt for r in ds.next_batch(7)]  # wraps into epochs 1 and 2 (reshuffled)
    other = PromptDataset.from_jsonl(p, "q", None, shuffle=True, seed=3)
    other.load_state_dict(state)
    assert [r.prompt for r in other.next_batch(7)] == expected
    assert state == {"epoch": 0, "offset": 4}


def test_sglang_fails_loud_without_the_package_or_a_gpu(tmp_path):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    ck = make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64)
    with pytest.raises(
        RuntimeError,
        match="--rollout-engine sglang: the Python package 'sglang' is not installed|--rollout-engine sglang needs a GPU",
    ):
        make_engine(EngineConfig(engine="sglang"), str(ck))


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
