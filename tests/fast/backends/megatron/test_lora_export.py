"""The Megatron backend's adapter export (``rl_plugin.backends.megatron.lora_export``) on one rank
(tiny Qwen2, ``--lora-rank 4 --target-modules all-linear``; the rank:
``tests.support.megatron_lora_state``): the stage's specs (canonical name, full shape, fp32) in
export order, one stage without a pipeline group, streamed tensors that are copies (valid after
the weights change), and nothing streamed by a DP rank other than 0. (TP / PP gathers and the
pipelined stream: ``test_lora.py``.)"""

from __future__ import annotations

import torch


def test_the_specs_are_the_adapters_in_export_order_in_fp32(lora_adapter_state):
    out = lora_adapter_state
    assert [n for n, _, _ in out["stage_specs"]] == out["names"]
    assert {d for _, _, d in out["stage_specs"]} == {torch.float32} and out["spec_dtypes"] == {"torch.float32"}
    assert out["one_stage"]


def test_the_stream_gives_copies_and_only_dp_rank_0_streams(lora_adapter_state):
    assert lora_adapter_state["copies"] and lora_adapter_state["dp1_streams_nothing"]
