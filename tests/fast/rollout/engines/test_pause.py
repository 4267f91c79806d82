"""Partial rollouts on the hf engine (``engines.pause``, ``hf_sampler.sample``'s gate): a weight
update at a token boundary; every token keeps the version that drew it and that version's
log-prob. retract: each token's log-prob equals its own version's, recomputed over the whole
sequence with that version's weights; in_place: the tokens before the update do, the later ones
ran on the old weights' cache. The gate itself: a caller waits for a token boundary."""

import threading

import pytest
import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.engines.base import SamplingParams, make_engine
from rl_plugin.rollout.engines.pause import GenerationGate

SWITCH_AT = 4  # the boundary (after this many tokens) at which version 1 is loaded


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("partial") / "m", "qwen2", vocab_size=64)


class SwitchingGate(GenerationGate):
    """Loads ``new_weights`` (version 1) at the SWITCH_AT-th boundary, as the manager's load would."""

    def __init__(self, engine, new_weights, mode):
        super().__init__(mode)
        self.engine, self.new_weights, self.calls = engine, new_weights, 0

    def boundary(self) -> int:
        self.calls += 1
        if self.calls == SWITCH_AT:
            with self.exclusive_now():
                self.engine.update_weights(self.new_weights)
                self.version = 1
        return super().boundary()

    def exclusive_now(self):
        self.leave()  # the generating thread itself: at a boundary
        return self.exclusive()


def _perturbed(engine, scale=0.05):
    g = torch.Generator().manual_seed(7)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in engine.weights().items()}


def _own_log_probs(engine, weights, gen, temperature):
    """log softmax(z / T) of each response token, the whole sequence run with ``weights``."""
    engine.update_weights(weights)
    ids = torch.tensor([gen.prompt_ids + gen.response_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float() / temperature
    p = len(gen.prompt_ids)
    lp = torch.log_softmax(logits[p - 1 : -1], -1)
    return lp.gather(-1, torch.tensor(gen.response_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_partial_trajectory_log_probs_are_each_versions_own(checkpoint, mode):
    torch.set_num_threads(1)
    engine = make_engine(EngineConfig(engine="hf"), str(checkpoint))
    old = {k: v.clone() for k, v in engine.weights().items()}  # weights() shares the model's storage
    new = _perturbed(engine)
    engine.eos_token_ids = [63]  # rarely drawn: long responses
    prompts = [[1, 5, 9, 4]] * 3 + [[1, 7, 3]] * 2
    params = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=12)
    gate = SwitchingGate(engine, new, mode)
    gens = engine.generate(prompts, params, seed=3, gate=gate)
    spanning = [g for g in gens if len(set(g.weight_versions)) == 2]
    assert spanning, [g.weight_versions for g in gens]
    for g in gens:
        assert len(g.weight_versions) == len(g.response_ids) == len(g.log_probs)
        assert g.weight_versions == sorted(g.weight_versions) and set(g.weight_versions) <= {0, 1}
    for g in spanning:
        v = torch.tensor(g.weight_versions)
        got = torch.tensor(g.log_probs)
        on_old, on_new = _own_log_probs(engine, old, g, 0.8), _own_log_probs(engine, new, g, 0.8)
        torch.testing.assert_close(got[v == 0], on_old[v == 0], atol=2e-5, rtol=0)
        if mode == "retract":
            torch.testing.assert_close(got[v == 1], on_new[v == 1], atol=2e-5, rtol=0)
        else:  # the first token after the update ran the new weights over the old weights' cache
            assert not torch.allclose(got[v == 1][:1], on_new[v == 1][:1], atol=2e-5)
            assert not torch.allclose(got[v == 1][:1], on_old[v == 1][:1], atol=2e-5)


def test_gate_caller_waits_for_a_token_boundary():
    gate, order = GenerationGate(), []
    gate.enter()  # the generating thread is in a forward pass
    t = threading.Thread(target=lambda: _exclusive(gate, order))
    t.start()
    t.join(0.2)
    assert t.is_alive() and order == []  # waiting: no boundary yet
    order.append("boundary")
    assert gate.boundary() == 5  # the caller ran here, and set the version
    t.join(2)
    assert order == ["boundary", "caller"] and gate.pauses == 1
    gate.leave()


def _exclusive(gate, order):
    with gate.exclusive():
        order.append("caller")
        gate.version = 5
