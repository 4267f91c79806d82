"""The backend interface's own code (``rl_plugin.backends.base.TrainBackend``), on a backend that
implements only the abstract methods: the role check of ``compute_log_probs``, routing replay
refused by a backend without routing passes, the default (non-streaming) weight export, the LoRA
defaults, and the training state that ``--offload-train`` moves."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.backends.base import TrainBackend
from rl_plugin.configs.run import RunConfig
from rl_plugin.loss import StepBatch


class PlainBackend(TrainBackend):
    """The abstract methods only: a linear model and its SGD optimizer (no torch.distributed)."""

    def __init__(self, config):
        self.config = config
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.model.register_buffer("scale", torch.ones(1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    @classmethod
    def from_config(cls, config):
        return cls(config)

    def forward(self, model, inputs, options):
        raise NotImplementedError

    def schedule(self, model, num_micro_batches, forward, loss, *, forward_only):
        raise NotImplementedError

    def optimizer_step(self):
        raise NotImplementedError

    def model_for(self, role):
        return self.model

    def export_hf_state_dict(self):
        return {"model.weight": self.model.weight.detach(), "model.bias": self.model.bias.detach()}

    def save_checkpoint(self, path, *, step, extra=None):
        return []

    def load_checkpoint(self, path):
        return {"step": 0, "extra": {}}


def _train_config(*flags):
    return RunConfig.from_args(parse_train_flags(list(flags))).train


def _batch():
    return StepBatch(
        tokens=torch.arange(6),
        total_lengths=torch.tensor([3, 3]),
        response_lengths=torch.tensor([1, 2]),
        loss_mask=torch.ones(3),
        advantages=torch.zeros(3),
        group_ids=torch.tensor([0, 0]),
    )


def test_from_args_builds_from_the_run_configs_train_config():
    backend = PlainBackend.from_args(parse_train_flags(["--lora-rank", "4"]))
    assert backend.config == _train_config("--lora-rank", "4") and backend.lora_enabled
    assert not PlainBackend(_train_config()).lora_enabled


def test_an_unknown_role_is_refused_before_any_pass():
    backend = PlainBackend(_train_config())
    with pytest.raises(
        ValueError, match=r"^compute_log_probs: role must be 'actor', 'ref' or 'teacher', got 'critic'$"
    ):
        backend.compute_log_probs(_batch(), role="critic")


def test_routing_replay_on_a_backend_without_routing_passes_is_refused():
    """R2 (``old``): the forward-only actor pass would record; R3 (``rollout``): every pass replays."""
    batch = _batch()
    old = PlainBackend(replace(_train_config(), routing_replay="old"))
    with pytest.raises(
        ValueError,
        match=r"^routing replay \(--use-rollout-routing-replay / --use-routing-replay\): PlainBackend has none$",
    ):
        old.compute_log_probs(batch)
    assert old.routing_pass is None  # nothing left set after the refusal
    batch.routed_experts = torch.zeros(3, 1, 2, dtype=torch.int16)
    rollout = PlainBackend(replace(_train_config(), routing_replay="rollout"))
    with pytest.raises(ValueError, match=r"PlainBackend has none$"):
        rollout.train_step(batch, num_groups=1)
    with pytest.raises(ValueError, match=r"the rollout carries no routed experts"):
        rollout.compute_log_probs(_batch(), role="ref")  # R3 without the engine's record


def test_the_default_export_stream_is_the_state_dict_and_specs_are_unknown():
    backend = PlainBackend(_train_config())
    streamed = list(backend.stream_hf_weights())
    assert [n for n, _ in streamed] == ["model.weight", "model.bias"]
    assert torch.equal(streamed[0][1], backend.model.weight) and backend.hf_weight_specs() is None
    assert backend.deterministic_forward()


def test_lora_exports_are_refused_by_a_backend_without_adapters():
    backend = PlainBackend(_train_config())
    with pytest.raises(NotImplementedError, match=r"^PlainBackend: no LoRA adapters to describe \(--lora-rank\)$"):
        backend.lora_adapter_specs()
    with pytest.raises(NotImplementedError, match=r"^PlainBackend: no LoRA adapters to stream \(--lora-rank\)$"):
        next(backend.stream_lora_adapters())


def test_state_tensors_are_the_models_and_the_optimizers():
    backend = PlainBackend(_train_config())
    m = backend.model
    ids = [id(t) for t in backend.state_tensors()]
    assert ids == [id(m.weight), id(m.bias), id(m.scale), id(m.weight), id(m.bias)]  # no grad, no state yet
    m(torch.ones(1, 3)).sum().backward()
    backend.optimizer.step()
    momentum = [backend.optimizer.state[p]["momentum_buffer"] for p in (m.weight, m.bias)]
    ids = [id(t) for t in backend.state_tensors()]
    assert ids == [id(t) for t in (m.weight, m.weight.grad, m.bias, m.bias.grad, m.scale, m.weight, m.bias, *momentum)]
    backend._ref_model = torch.nn.Linear(1, 1, bias=False)  # the frozen reference model follows the actor's
    assert id(backend._ref_model.weight) in [id(t) for t in backend.state_tensors()]


def test_policy_and_value_passes_are_refused_on_the_other_kind_of_model():
    """A policy backend has no value head; a value backend (``value_head``) has no LM head."""
    policy = PlainBackend(_train_config())
    with pytest.raises(ValueError, match=r"^compute_values: this PlainBackend is a policy \(TrainConfig.value_head"):
        policy.compute_values(_batch())
    with pytest.raises(ValueError, match=r"^value_train_step: this PlainBackend is a policy"):
        policy.value_train_step(_batch(), num_groups=1)
    critic = PlainBackend(replace(_train_config(), value_head=True))
    with pytest.raises(ValueError, match=r"^compute_log_probs: this PlainBackend is a value model .*compute_values"):
        critic.compute_log_probs(_batch())
    with pytest.raises(ValueError, match=r"^train_step: this PlainBackend is a value model"):
        critic.train_step(_batch(), num_groups=1)
    assert _train_config().value_head is False  # a plain field, never set by a flag
