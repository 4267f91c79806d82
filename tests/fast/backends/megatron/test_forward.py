"""Sequence parallelism pads the packed micro-batch to TP*CP (``cp.sequence_parallel_padding``,
``backends.megatron.forward.model_inputs``): megatron-core's SP scatter splits each CP rank's
local stream over TP. Without SP (``sp_size=1``) the model inputs are exactly the layout's."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.backends.megatron.forward import model_inputs, padded_logit_index
from rl_plugin.cp import all_rank_layouts, sequence_parallel_padding
from rl_plugin.loss.backend_api import MicroBatchInputs


def test_padding_formula():
    assert sequence_parallel_padding(7, 2, 1) == 1
    assert sequence_parallel_padding(8, 2, 1) == 0
    assert sequence_parallel_padding(7, 1, 1) == 0  # TP 1: SP is a no-op
    assert sequence_parallel_padding(0, 4, 1) == 0
    assert sequence_parallel_padding(5, 4, 1) == 3
    assert sequence_parallel_padding(12, 2, 2) == 0  # 12 % lcm(4, 4)
    assert sequence_parallel_padding(8, 3, 2) == 4  # lcm(6, 4) = 12
    assert sequence_parallel_padding(4, 3, 2) == 8
    for packed in range(0, 97, 4):
        for tp in (1, 2, 3, 4, 8):
            e = sequence_parallel_padding(packed, tp, 2)
            assert e % 4 == 0 and (packed + e) // 2 % tp == 0 and e < math.lcm(2 * tp, 4)
    with pytest.raises(ValueError, match=r"packed_length=6 is not a multiple of 2\*cp=4"):
        sequence_parallel_padding(6, 2, 2)


def _inputs(lengths, responses, cp_size, qkv_format="thd", max_seq_len=None):
    tokens = torch.arange(1, sum(lengths) + 1)
    out = []
    for lay in all_rank_layouts(lengths, responses, cp_size=cp_size, qkv_format=qkv_format, max_seq_len=max_seq_len):
        out.append(
            MicroBatchInputs(
                layout=lay,
                input_ids=lay.local_inputs(tokens),
                position_ids=lay.local_position_ids(),
                targets=lay.targets(tokens),
            )
        )
    return out


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_thd_packed_stream_divides_by_tp(tp, cp_size):
    lengths, responses = [5, 3, 7], [2, 1, 3]
    for mb in _inputs(lengths, responses, cp_size):
        ids, pos, psp = model_inputs(mb, "thd", sp_size=tp)
        real = mb.input_ids.numel()
        assert ids.shape[1] % tp == 0 and ids.shape[1] - real < math.lcm(tp * cp_size, 2)
        assert torch.equal(ids[0, :real], mb.input_ids) and torch.equal(pos[0, :real], mb.position_ids)
        assert (ids[0, real:] == 0).all()
        cu = mb.layout.cu_seqlens_padded
        extra = ids.shape[1] * cp_size - int(cu[-1])  # global length of the padding segment
        if extra:  # one more segment, after the samples, its zigzag share on this rank
            assert torch.equal(psp.cu_seqlens_q[:-1], cu) and int(psp.cu_seqlens_q[-1]) == int(cu[-1]) + extra
            assert cp_size == 1 or extra % (2 * cp_size) == 0  # cut into 2*CP zigzag chunks like a sample
            assert int(pos[0, real:].max()) < extra
        else:
            assert torch.equal(psp.cu_seqlens_q, cu)
        assert torch.equal(padded_logit_index(mb, ids), mb.layout.logit_index)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_without_sequence_parallel_nothing_changes(cp_size):
    for mb in _inputs([5, 3, 7], [2, 1, 3], cp_size):
        ids, pos, psp = model_inputs(mb, "thd")
        assert torch.equal(ids, mb.input_ids.view(1, -1)) and torch.equal(pos, mb.position_ids.view(1, -1))
        cu = mb.layout.cu_seqlens_padded
        assert torch.equal(psp.cu_seqlens_q, cu) and torch.equal(psp.cu_seqlens_kv_padded, cu)
        assert psp.max_seqlen_q == int(mb.layout.padded_lengths.max())
    (mb,) = _inputs([5, 3, 7], [2, 1, 3], 1, "bshd")
    ids, pos, psp = model_inputs(mb, "bshd")
    assert ids is mb.input_ids and pos is mb.position_ids and psp is None


def test_bshd_rows_pad_at_their_end_and_the_index_follows():
    (mb,) = _inputs([5, 3, 7], [2, 1, 3], 1, "bshd")
    ids, pos, _ = model_inputs(mb, "bshd", sp_size=4)
    assert ids.shape == (3, 8) and torch.equal(ids[:, :7], mb.input_ids) and (ids[:, 7:] == 0).all()
    assert torch.equal(pos[:, :7], mb.position_ids) and (pos[:, 7] == 7).all()
    index = padded_logit_index(mb, ids)
    assert torch.equal(ids.reshape(-1)[index], mb.input_ids.reshape(-1)[mb.layout.logit_index])
    # CP > 1 chunks by --seq-length: a width TP does not divide is refused, naming the fix
    mb = _inputs([5, 3], [2, 1], 2, "bshd", max_seq_len=8)[0]  # rows of 8 / CP = 4 tokens
    assert model_inputs(mb, "bshd", sp_size=2)[0] is mb.input_ids
    with pytest.raises(ValueError, match=r"--seq-length that is a multiple of 12, or --qkv-format thd"):
        model_inputs(mb, "bshd", sp_size=3)
