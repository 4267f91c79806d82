"""What the Megatron LoRA refuses, by name, before anything is built; and the fused-layout
placement of ``lora.FusedLayout`` on a hand-made example."""

from __future__ import annotations

import pytest
import torch


def _cfgs(*flags):
    from rl_plugin.configs import TrainConfig
    from tests.support.megatron_common import make_args

    cfg = TrainConfig.from_args(make_args("--lora-rank", "8", *flags, world_size=2))
    return cfg.model, cfg.lora


@pytest.mark.parametrize(
    "flags, experts, words",
    [
        (("--sequence-parallel", "--tensor-model-parallel-size", "2"), 0, "--sequence-parallel"),
        (("--context-parallel-size", "2"), 0, "--context-parallel-size 2"),
        ((), 4, "mixture-of-experts"),
    ],
    ids=["sequence_parallel", "context_parallel", "moe"],
)
def test_refused_layouts_name_the_flag(flags, experts, words):
    from rl_plugin.backends.megatron.lora_model import LoraSetupError, check_lora_supported

    model, lora = _cfgs(*flags)
    with pytest.raises(LoraSetupError, match=words) as err:
        check_lora_supported(model, lora, num_experts=experts)
    assert "Fix:" in str(err.value)


def test_no_lora_checks_nothing():
    """The rules are LoRA's: without ``--lora-rank`` a CP 2 MoE layout passes, and the same layout
    with ``--lora-rank`` is refused (so the pass is the disabled LoRA's, not a missed rule)."""
    from rl_plugin.backends.megatron.lora_model import LoraSetupError, check_lora_supported
    from rl_plugin.configs import TrainConfig
    from tests.support.megatron_common import make_args

    cfg = TrainConfig.from_args(make_args("--context-parallel-size", "2", world_size=2))
    assert not cfg.lora.enabled and cfg.model.context_parallel_size == 2
    assert check_lora_supported(cfg.model, cfg.lora, num_experts=4) is None
    model, lora = _cfgs("--context-parallel-size", "2")
    assert lora.enabled
    with pytest.raises(LoraSetupError, match="--lora-rank with --context-parallel-size 2"):
        check_lora_supported(model, lora, num_experts=4)


def test_fused_layout_interleaves_per_group():
    """2 query groups, q 4 rows / k 2 / v 2 per group: [q0 k0 v0 q1 k1 v1] (megatron's linear_qkv);
    an untargeted projection (k) is zeros in its slots."""
    from rl_plugin.backends.megatron.lora import FusedLayout

    layout = FusedLayout(2, (4, 2, 2))
    q = torch.arange(8.0).view(1, 8) + 100
    v = torch.arange(4.0).view(1, 4) + 300
    out = layout.place([q, None, v])
    want = torch.tensor([[100, 101, 102, 103, 0, 0, 300, 301, 104, 105, 106, 107, 0, 0, 302, 303]], dtype=torch.float)
    assert torch.equal(out, want)
    gate_up = FusedLayout(1, (3, 3)).place([torch.ones(2, 3), 2 * torch.ones(2, 3)])
    assert torch.equal(gate_up, torch.tensor([[1.0, 1, 1, 2, 2, 2]] * 2))
