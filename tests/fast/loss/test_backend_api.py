"""The types that cross the loss core's interface to a backend (``rl_plugin.loss.backend_api``):
a micro-batch's model inputs, its targets at the logit positions that predict them, positions that
restart per sample, the routed experts in input order, and the same tokens split over CP ranks."""

from __future__ import annotations

import torch

from rl_plugin.loss import LossConfig, StepBatch
from rl_plugin.loss.backend_api import ForwardOptions, MicroBatchInputs

# two samples: prompt [10, 11] + response [12, 13, 14]; prompt [20] + response [21, 22]
TOKENS = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22])


def _batch(**over):
    fields = dict(
        tokens=TOKENS,
        total_lengths=torch.tensor([5, 3]),
        response_lengths=torch.tensor([3, 2]),
        loss_mask=torch.ones(5),
        advantages=torch.zeros(5),
        group_ids=torch.tensor([0, 0]),
    )
    fields.update(over)
    return StepBatch(**fields)


def test_thd_inputs_targets_and_positions():
    mb = MicroBatchInputs.build(_batch())
    assert mb.input_ids.tolist() == TOKENS.tolist()
    assert mb.position_ids.reshape(-1).tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.targets.tolist() == [12, 13, 14, 21, 22]
    # the logit at position p predicts the token at p + 1
    assert mb.input_ids.reshape(-1)[mb.layout.logit_index + 1].tolist() == mb.targets.tolist()
    assert mb.routed_experts is None and mb.recorded_routing is None


def test_bshd_rows_are_padded_to_the_sequence_length():
    mb = MicroBatchInputs.build(_batch(), qkv_format="bshd", max_seq_len=6)
    assert mb.input_ids.shape == (2, 6)
    assert mb.input_ids[0, :5].tolist() == [10, 11, 12, 13, 14] and mb.input_ids[1, :3].tolist() == [20, 21, 22]
    assert mb.targets.tolist() == [12, 13, 14, 21, 22]
    assert mb.input_ids.reshape(-1)[mb.layout.logit_index + 1].tolist() == mb.targets.tolist()


def test_routed_experts_follow_the_inputs():
    routed = torch.arange(8, dtype=torch.int16).view(8, 1, 1) * 10
    mb = MicroBatchInputs.build(_batch(routed_experts=routed), qkv_format="bshd", max_seq_len=6)
    assert mb.routed_experts[:, 0, 0].tolist() == [0, 10, 20, 30, 40, -1, 50, 60, 70, -1, -1, -1]


def test_cp_ranks_split_the_response_tokens_once():
    parts = [MicroBatchInputs.build(_batch(), cp_rank=r, cp_size=2) for r in range(2)]
    full = torch.zeros(5, dtype=torch.long)
    owned = torch.zeros(5, dtype=torch.long)
    for mb in parts:
        full[mb.layout.resp_index] = mb.targets
        owned[mb.layout.resp_index] += 1
    assert full.tolist() == [12, 13, 14, 21, 22] and owned.tolist() == [1] * 5


def test_forward_options_of_the_loss_config():
    cfg = LossConfig(temperature=0.7, logprob_chunk_size=256)
    assert ForwardOptions.of(cfg, with_entropy=True) == ForwardOptions(
        temperature=0.7, chunk_size=256, with_entropy=True
    )
