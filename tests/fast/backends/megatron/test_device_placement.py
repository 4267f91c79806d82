"""GPU placement of the Megatron backend's inputs, checked on the CPU with a fake target device
("meta": a tensor there cannot be copied to or mixed with a CPU one, so a CPU tensor that should
have moved shows in its ``.device``), and the idle pass's shape under the sequence-parallel
padding rules (issue 37 items 1, 4, 5). What only a GPU proves (TE's thd kernels taking these
tensors, NCCL reducing them) is in ``tests/gpu``."""

from __future__ import annotations

import math
import types

import pytest
import torch

from rl_plugin.backends.megatron import moe, step
from rl_plugin.backends.megatron.forward import response_logits, stage_output
from rl_plugin.cp import all_rank_layouts
from rl_plugin.loss.backend_api import MicroBatchInputs

VOCAB = 8


class _RecordingModel(torch.nn.Module):
    """Stands in for the GPTModel on ``device``: records what ``forward`` receives, returns
    ``[1, s, V]`` zeros there (logits) that depend on its one parameter."""

    def __init__(self, device, *, tp: int = 1, sp: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros((), device=device))
        self.config = types.SimpleNamespace(sequence_parallel=sp, tensor_model_parallel_size=tp)
        self.calls = []

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None, **kwargs):
        self.calls.append((input_ids, position_ids, packed_seq_params))
        return self.w * torch.zeros(*input_ids.shape, VOCAB, device=input_ids.device)


def _micro_batches(cp_size: int, qkv_format: str = "thd"):
    lengths, responses = [5, 3, 7], [2, 1, 3]
    tokens = torch.arange(1, sum(lengths) + 1)
    return [
        MicroBatchInputs(
            layout=lay,
            input_ids=lay.local_inputs(tokens),
            position_ids=lay.local_position_ids(),
            targets=lay.targets(tokens),
        )
        for lay in all_rank_layouts(lengths, responses, cp_size=cp_size, qkv_format=qkv_format, max_seq_len=8)
    ]


CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


@pytest.mark.parametrize("cp_size", [1, 2])
def test_packed_seq_params_on_the_model_device(cp_size):
    """Item 1: TE's thd attention reads cu_seqlens(_padded) on the GPU; they were CPU tensors."""
    for mb in _micro_batches(cp_size):
        for run in (stage_output, lambda m, b, f: response_logits(m, b, qkv_format=f, fp32_lm_head=False)):
            model = _RecordingModel("meta")
            run(model, mb, "thd")
            ids, pos, psp = model.calls[-1]
            assert ids.device.type == pos.device.type == "meta"
            for name in CU_FIELDS:
                assert getattr(psp, name).device.type == "meta", name


@pytest.mark.parametrize("qkv_format", ["thd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_idle_pass_shape_is_valid_under_sequence_parallel_and_cp(tp, cp_size, qkv_format):
    """Item 4: an EP idle pass sent one token; under --sequence-parallel its sequence must split
    over TP, and under CP > 1 each rank's share is two zigzag chunks (the rules of
    ``cp.sequence_parallel_padding`` / ``tests/fast/backends/megatron/test_forward.py``)."""
    for cp_rank in range(cp_size):
        model = _RecordingModel("cpu", tp=tp, sp=tp > 1)
        out = step.idle_forward(model, torch.device("cpu"), cp_rank=cp_rank, cp_size=cp_size, qkv_format=qkv_format)
        assert out.shape == (0, 2) and out.requires_grad
        ids, pos, psp = model.calls[-1]
        local = ids.shape[-1]
        assert ids.shape[0] == 1 and local % tp == 0 and pos.shape == ids.shape
        if cp_size > 1:
            assert local % 2 == 0  # two non-empty zigzag chunks on every CP rank
        if qkv_format == "thd":
            cu = psp.cu_seqlens_q
            assert int(cu[-1]) == local * cp_size  # the global packed length of the local shares
            segments = cu[1:] - cu[:-1]
            assert bool((segments > 0).all()) and bool((segments % (2 * cp_size if cp_size > 1 else 1) == 0).all())
        else:
            assert psp is None
        assert local * cp_size <= math.lcm(2 * cp_size, tp * cp_size, 2)  # the smallest valid shape


def test_idle_pass_runs_from_an_empty_micro_batch_in_its_layout():
    """``micro_batch_forward`` hands the empty micro-batch's CP layout to the idle pass."""
    from rl_plugin.loss import StepBatch
    from rl_plugin.parallel import ParallelState

    empty = StepBatch(
        tokens=torch.zeros(0, dtype=torch.long),
        total_lengths=torch.zeros(0, dtype=torch.long),
        response_lengths=torch.zeros(0, dtype=torch.long),
        loss_mask=torch.zeros(0),
        advantages=torch.zeros(0),
        group_ids=torch.zeros(0, dtype=torch.long),
    )
    mb = MicroBatchInputs.build(empty, cp_rank=1, cp_size=2, qkv_format="thd")
    model = _RecordingModel("cpu", tp=2, sp=True)
    kwargs = dict(qkv_format="thd", fp32_lm_head=False, fused=False, idle_passes=True)
    out = step.micro_batch_forward(model, mb, None, ParallelState.single(), torch.device("cpu"), **kwargs)
    assert out.shape == (0, 2)
    ids, _, psp = model.calls[-1]
    assert ids.shape[-1] % 2 == 0 and int(psp.cu_seqlens_q[-1]) == 2 * ids.shape[-1]  # CP 2's share, TP 2


def test_router_metrics_reduce_over_cp_on_the_loss_device(monkeypatch):
    """Item 5: the router-loss metrics' CP sum is on megatron's CP group (NCCL on GPUs): the tensor
    must be on the loss device (it was a CPU float64 tensor); the DP mean stays on the CPU (gloo)."""
    import rl_plugin.parallel as parallel

    seen = []

    def all_reduce(t, group, op=None):
        seen.append((group, t.device.type, t.dtype))
        return torch.ones(t.shape, dtype=t.dtype) if t.device.type == "meta" else t

    monkeypatch.setattr(parallel, "all_reduce", all_reduce)
    config = types.SimpleNamespace(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3
    )
    ps = types.SimpleNamespace(cp_group="cp", dp_group="dp", dp_size=2)
    out = moe.aux_loss_metrics(config, 2, 1, ps, device=torch.device("meta"))
    assert seen == [("cp", "meta", torch.float64), ("dp", "cpu", torch.float64)]
    assert out == {"moe_load_balancing_loss": 0.5, "moe_z_loss": 0.5}
