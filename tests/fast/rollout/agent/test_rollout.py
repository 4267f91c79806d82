"""Issue 36: the agent endpoint against the real ``openai`` client, the hf engine on a tiny
random Llama that carries SmolLM2's real tokenizer and ChatML template (the rollout manager runs
in this process; the agents are ``tests.support.agent_programs``)."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("openai")

from rl_plugin.arguments.embedded import parse_train_flags  # noqa: E402
from rl_plugin.configs import RolloutConfig  # noqa: E402
from rl_plugin.models.smollm2 import tiny_chat_checkpoint  # noqa: E402
from rl_plugin.rollout.agent.rollout import AgentRaisedError, AgentSessionUnusedError, AgentTimeoutError  # noqa: E402
from rl_plugin.rollout.manager import RolloutManager  # noqa: E402
from tests.support import agent_programs as agents  # noqa: E402
from tests.support.real_tokenizer import smollm2_tokenizer_path  # noqa: E402

RM = "def reward(prompt, response, label):\n    return float(len(response) % 3)\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    model = tiny_chat_checkpoint(root / "model", smollm2_tokenizer_path().parent)
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} + 2?", "label": str(i + 2)}) for i in range(16)))
    (root / "rm.py").write_text(RM)
    return root, model, data


def manager(setup, agent: str, *extra: str, batch: int = 2, n: int = 2, max_len: int = 16) -> RolloutManager:
    root, model, data = setup
    agents.SEEN.clear()
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", str(batch)]
    argv += ["--n-samples-per-prompt", str(n), "--rollout-max-response-len", str(max_len), "--num-rollout", "1"]
    argv += ["--custom-agent-function-path", f"tests.support.agent_programs:{agent}"]
    argv += ["--custom-rm-path", f"{root / 'rm.py'}:reward", "--output-dir", str(root / "out"), *extra]
    args = parse_train_flags(argv)
    return RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)


def split(data):
    """Per sample: (prompt ids, response ids, loss mask, rollout log-probs)."""
    toks = data.tokens.split(data.total_lengths.tolist())
    rl = data.response_lengths.tolist()
    masks, lps = data.loss_mask.split(rl), data.rollout_log_probs.split(rl)
    return [(t[: len(t) - r].tolist(), t[len(t) - r :].tolist(), m, lp) for t, r, m, lp in zip(toks, rl, masks, lps)]


def test_two_turn_append_only_episode_is_one_sample_trained_on_the_completions(setup):
    m = manager(setup, "two_turns")
    data = m.generate(0)
    seen = agents.SEEN["two_turns"]
    assert len(seen) == 4 and data.stats["agent/non_append_turns"] == 0 and data.stats["agent/samples"] == 4
    tok = m.generation.agent.template.tok
    by_prompt = {}
    for _base_url, prompt, r1, r2 in seen:
        # turn 1: the prompt ids are the template's tokenisation of the chat
        msgs = [{"role": "user", "content": prompt}]
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r1.prompt_token_ids == list(want)
        out1, out2 = r1.choices[0].token_ids, r2.choices[0].token_ids
        # turn 2 extends turn 1's prompt + output ids exactly (token in, token out)
        assert r2.prompt_token_ids[: len(want) + len(out1)] == list(want) + out1
        assert r1.usage.completion_tokens == len(out1) and r2.usage.prompt_tokens == len(r2.prompt_token_ids)
        by_prompt.setdefault(tuple(want), []).append((r1, r2))
    samples = split(data)
    assert len(samples) == 4 and data.group_ids.tolist() == [0, 0, 1, 1]
    matched = 0
    for prompt_ids, resp, mask, lp in samples:
        for r1, r2 in by_prompt[tuple(prompt_ids)]:
            out1, out2 = r1.choices[0].token_ids, r2.choices[0].token_ids
            if prompt_ids + resp != r2.prompt_token_ids + out2:
                continue
            matched += 1
            trained = [t for t, k in zip(resp, mask.tolist()) if k == 1]
            assert trained == out1 + out2  # exactly the completions, nothing the template added
            api_lp = [x.logprob for x in r1.choices[0].logprobs.content + r2.choices[0].logprobs.content]
            assert lp[mask == 1].tolist() == pytest.approx(api_lp, abs=1e-6)  # recorded as served
            assert (lp[mask == 0] == 0).all()
    assert matched == 4
    # the run's reward (RM: len(response) % 3) on the final conversation: every token after the prompt
    want = [float(len(tok.decode(resp, skip_special_tokens=True)) % 3) for _, resp, _, _ in samples]
    assert data.rewards.tolist() == want
    assert data.stats["agent/model_tokens"] == data.stats["agent/completion_tokens"] == data.loss_mask.sum()


def test_log_probs_equal_the_engines(setup):
    """The served log-probs are the engine's: a forward of the hf model over the sample at the
    run's temperature (1.0) gives the same numbers."""
    from transformers import AutoModelForCausalLM

    m = manager(setup, "two_turns", batch=1, n=2)
    data = m.generate(0)
    model = AutoModelForCausalLM.from_pretrained(setup[1], dtype=torch.float32).eval()
    for prompt_ids, resp, mask, lp in split(data):
        ids = torch.tensor([prompt_ids + resp])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
        assert int(mask.sum()) >= 2
        assert lp[mask == 1].tolist() == pytest.approx(ref[mask == 1].tolist(), abs=2e-4)


def test_history_rewriting_episode_becomes_per_turn_samples(setup):
    data = manager(setup, "rewrite_history").generate(0)
    assert data.stats["agent/non_append_turns"] == 4 and data.stats["agent/samples"] == 8
    assert data.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and data.num_groups == 2
    assert (data.rewards == 0.5).all()  # the agent's number wins, shared by the episode's samples
    served = {(tuple(r.choices[0].token_ids)) for pair in agents.SEEN["rewrite_history"] for r in pair}
    for _, resp, mask, _ in split(data):
        assert mask.tolist() == [1] * len(resp) and tuple(resp) in served  # each sample: its own completion


def test_episode_budget_cuts_with_length_and_completions_endpoint(setup):
    data = manager(setup, "budget", max_len=8).generate(0)
    for out in agents.SEEN["budget"]:
        got = [r.usage.completion_tokens for r in out]
        assert sum(got) <= 8 and out[-1].choices[0].finish_reason == "length"
        assert got[2] == 0 or sum(got) == 8
    assert data.stats["agent/model_tokens"] <= 8 * 4 and data.rewards.tolist() == [1.0] * len(data.rewards)
    data = manager(setup, "completions", batch=1, n=2).generate(0)
    (r1, r2), _ = agents.SEEN["completions"]
    assert data.stats["agent/samples"] == 2 and data.stats["agent/non_append_turns"] == 0
    prompt_ids, resp, mask, lp = next(
        s for s in split(data) if s[1][: len(r1.choices[0].token_ids)] == r1.choices[0].token_ids
    )
    assert prompt_ids == [1, 9, 10, 11] and mask.tolist() == [1] * len(r1.choices[0].token_ids) + [0, 0] + [1] * len(
        r2.choices[0].token_ids
    )
    assert lp[mask == 1].tolist() == pytest.approx(
        r1.choices[0].logprobs.token_logprobs + r2.choices[0].logprobs.token_logprobs, abs=1e-6
    )


def test_64_concurrent_sessions(setup):
    m = manager(setup, "many", batch=16, n=4)
    data = m.generate(0)
    assert len(agents.SEEN["many"]) == 64 and data.stats["agent/calls"] == 128
    assert data.stats["agent/engine_calls"] < 64  # the sessions' requests share engine calls
    print("64 sessions:", {k: v for k, v in data.stats.items() if k.startswith("agent/")})
    assert data.stats["agent/model_tokens"] == sum(agents.SEEN["many"])  # trained tokens = usage the agents got
    assert data.num_groups == 16 and data.group_ids.bincount().tolist() == [4] * 16
    assert m.generation.agent.server.port > 0


def test_failures_are_named_and_answered(setup):
    t0 = time.perf_counter()
    with pytest.raises(AgentRaisedError, match=r"raises.*raised on sample \d.*KeyError.*no 'result'"):
        manager(setup, "raises", batch=2, n=2).generate(0)
    assert time.perf_counter() - t0 < 30  # the other episodes were cancelled, not awaited
    with pytest.raises(AgentTimeoutError, match=r"--agent-timeout 0.5 s"):
        manager(setup, "sleeps", "--agent-timeout", "0.5", batch=1, n=2).generate(0)
    assert agents.SEEN["abort"] == [True]  # the module's abort(args), once
    with pytest.raises(AgentSessionUnusedError, match="without one completion"):
        manager(setup, "unused", batch=1, n=2).generate(0)
    data = manager(setup, "refused", batch=1, n=2).generate(0)
    (out,) = agents.SEEN["refused"]
    assert out["ended"][0] == 409 and "episode ended" in out["ended"][2]
    assert out["unknown"][0] == 404 and "unknown session" in out["unknown"][2]
    for name, param in (("stream", "stream"), ("stop", "stop"), ("greedy", "temperature"), ("n", "n")):
        assert out[name][0] == 400 and param in out[name][2], (name, out[name])
    assert out["top_logprobs"][0] == 400
    assert data.stats["agent/rejected_requests"] == 2
