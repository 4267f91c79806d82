"""The pipelined weight export's pure parts (``rl_plugin.backends.megatron.pipeline_export``): the
export's meta specs in stream order and the messages a stage sends rank 0. (The export itself on
PP2 x TP2: ``tests/fast/parity/test_pipeline.py`` runs ``weight_sync/test_weight_export_stream``'s
worker.)"""

from __future__ import annotations

import torch

from rl_plugin.backends.megatron.pipeline_export import MESSAGE_BYTES, message_groups, pipeline_specs


def test_pipeline_specs_are_meta_tensors_stage_after_stage():
    stages = [
        [
            ("model.embed_tokens.weight", (10, 4), torch.float32),
            ("model.layers.0.mlp.up_proj.weight", (8, 4), torch.bfloat16),
        ],
        [("model.layers.1.mlp.up_proj.weight", (8, 4), torch.bfloat16), ("lm_head.weight", (10, 4), torch.float32)],
    ]
    specs = pipeline_specs(stages)
    assert list(specs) == [name for stage in stages for name, _, _ in stage]
    assert all(t.device.type == "meta" for t in specs.values())
    assert [(tuple(t.shape), t.dtype) for t in specs.values()] == [(s, d) for stage in stages for _, s, d in stage]


def test_pipeline_messages_pack_runs_of_one_dtype_within_the_budget():
    """Consecutive tensors of one dtype share a message up to the byte budget; a dtype change or a
    tensor past the budget starts a new one; a tensor larger than the budget goes alone."""
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [("a", (4,), f32), ("b", (2, 2), f32), ("c", (3,), bf16), ("d", (100,), f32), ("e", (1,), f32)]
    assert message_groups(specs, budget=40) == [[0, 1], [2], [3], [4]]
    assert message_groups(specs, budget=1 << 20) == [[0, 1], [2], [3, 4]]
    assert message_groups([], budget=40) == []
    assert message_groups(specs) == [[0, 1], [2], [3, 4]] and MESSAGE_BYTES == 32 << 20
