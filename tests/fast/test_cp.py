"""The zigzag CP layout against a brute-force model of Megatron's chunking."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.cp import all_rank_layouts, build_response_layout, expand_runs, padded_lengths

TOTAL = [7, 5, 9, 2, 13]
RESP = [3, 1, 4, 1, 0]


def brute_force(total, resp, cp_rank, cp_size, fmt, max_seq_len):
    """Walk every position of every padded sequence; return the rank's (resp, logit, target) lists."""
    resp_idx, logit_idx, target_idx, inputs = [], [], [], []
    resp_off = tok_off = local_off = 0
    for t, r in zip(total, resp):
        if fmt == "thd":
            padded = -(-t // (2 * cp_size)) * 2 * cp_size if cp_size > 1 else t
        else:
            padded = -(-max_seq_len // (2 * cp_size)) * 2 * cp_size if cp_size > 1 else max_seq_len
        if cp_size > 1:
            ch = padded // (2 * cp_size)
            owned = list(range(cp_rank * ch, (cp_rank + 1) * ch)) + list(
                range((2 * cp_size - 1 - cp_rank) * ch, (2 * cp_size - cp_rank) * ch)
            )
        else:
            owned = list(range(padded))
        p0 = t - r - 1
        for local, pos in enumerate(owned):
            inputs.append(tok_off + pos if pos < t else -1)
            if p0 <= pos < t - 1:
                resp_idx.append(resp_off + pos - p0)
                logit_idx.append(local_off + local)
                target_idx.append(tok_off + pos + 1)
        resp_off += r
        tok_off += t
        local_off += len(owned)
    return resp_idx, logit_idx, target_idx, inputs


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_layout_matches_brute_force(fmt, cp_size):
    for r in range(cp_size):
        lay = build_response_layout(TOTAL, RESP, cp_rank=r, cp_size=cp_size, qkv_format=fmt, max_seq_len=16)
        want = brute_force(TOTAL, RESP, r, cp_size, fmt, 16)
        assert lay.resp_index.tolist() == want[0]
        assert lay.logit_index.tolist() == want[1]
        assert lay.target_index.tolist() == want[2]
        assert lay.input_index.tolist() == want[3]


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_every_response_token_owned_exactly_once(fmt, cp_size):
    layouts = all_rank_layouts(TOTAL, RESP, cp_size=cp_size, qkv_format=fmt, max_seq_len=16)
    owned = torch.cat([lay.resp_index for lay in layouts]).sort().values
    assert owned.tolist() == list(range(sum(RESP)))


def test_local_inputs_and_slice():
    tokens = torch.arange(100, 100 + sum(TOTAL))
    lay = build_response_layout(TOTAL, RESP, cp_rank=1, cp_size=2, qkv_format="thd")
    ids = lay.local_inputs(tokens, pad_id=-7)
    assert ids.numel() == int(lay.local_lengths.sum())
    assert ((ids == -7) == (lay.input_index < 0)).all()
    assert lay.cu_seqlens_padded.tolist()[-1] == int(padded_lengths(torch.tensor(TOTAL), 2, "thd").sum())
    bshd = build_response_layout(TOTAL, RESP, cp_rank=0, cp_size=2, qkv_format="bshd", max_seq_len=16)
    assert tuple(bshd.local_inputs(tokens).shape) == (5, 8)
    x = torch.arange(sum(RESP), dtype=torch.float64)
    assert torch.equal(lay.slice(x), x[lay.resp_index])
    # the targets really are the next tokens: target position = logit position + 1
    full = build_response_layout(TOTAL, RESP)
    assert torch.equal(full.targets(tokens), tokens[full.logit_index + 1])


def test_bshd_cp_without_max_seq_len_raises_never_falls_back_to_thd():
    with pytest.raises(ValueError, match="bshd context parallelism needs max_seq_len"):
        build_response_layout(TOTAL, RESP, cp_rank=0, cp_size=2, qkv_format="bshd")


def test_bad_layout_inputs_name_the_sample():
    with pytest.raises(ValueError, match="sample 1: response_length=5 leaves no prompt token"):
        build_response_layout([4, 5], [1, 5])
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        build_response_layout([4, 9], [1, 2], qkv_format="bshd", max_seq_len=8)
    with pytest.raises(ValueError, match="qkv_format"):
        build_response_layout([4], [1], qkv_format="sbhd")


def test_expand_runs():
    assert expand_runs(torch.tensor([5, 0, 9]), torch.tensor([2, 3, 0])).tolist() == [5, 6, 0, 1, 2]
    assert expand_runs(torch.tensor([3]), torch.tensor([0])).numel() == 0


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_an_empty_micro_batch_has_empty_inputs(fmt):
    """A DP rank past its own micro-batch count runs an empty one (FSDP's idle pass): bshd's
    ``[S, L]`` view of zero samples is ``[0, 0]``, not a reshape error."""
    empty = torch.zeros(0, dtype=torch.long)
    lay = build_response_layout(empty, empty, qkv_format=fmt, max_seq_len=16 if fmt == "bshd" else None)
    want = (0, 0) if fmt == "bshd" else (0,)
    assert tuple(lay.local_inputs(empty).shape) == want and tuple(lay.local_position_ids().shape) == want
    assert lay.num_local_tokens == 0
