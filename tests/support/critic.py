"""Shared pieces of the critic's tests (issue 47): a value step's data, a value checkpoint, value
backends built from flags, the per-sample reference, and one worker that runs value steps over
layouts on any backend (the FSDP layouts here; the Megatron layouts and the cross-backend
comparison reuse ``value_worker`` with ``backend="megatron"``).

    data = value_step_data(seed)                       # dict of StepBatch fields (values, returns)
    ckpt = value_checkpoint(tmp_root, tiny_ckpt)       # the tiny LM as a critic, random head
    per_rank = run_world(value_worker, dp, "fsdp", ckpt, data, cases)   # cases: {name: flags}
    j, grad_norm, values = reference_value_step(ckpt, data, mode)        # unsharded HF, per sample
    data = around_predictions(data, values)            # old values near a model's predictions
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from tests.support import reference as ref
from tests.support.flags import EXACT_SGD
from tests.support.fsdp_common import make_step, parse, step_batch

VALUE_CLIP = 0.2
DIVISOR = 8.0
MODES = {
    "sample_mean": [],
    "token_mean": ["--loss-aggregation", "token_mean"],
    "prompt_mean": ["--loss-aggregation", "prompt_mean"],
    "constant": ["--loss-aggregation", "constant", "--loss-aggregation-divisor", str(DIVISOR)],
}


def value_step_data(seed: int = 0) -> dict:
    """``fsdp_common.make_step``'s 9 samples in 3 groups (uneven, one-token and zero-length
    responses, an all-masked sample) with a masked middle segment (a tool turn at positions 1-2 of
    every response of 4+ tokens), the critic's old ``values`` and GAE-like ``returns`` (fp32; the
    old values within +-0.3 of the returns, so the clip range 0.2 cuts some tokens and not others)."""
    step = make_step(seed, with_ref=False)
    step.pop("old_log_probs")
    resp = step["response_lengths"]
    sid = torch.repeat_interleave(torch.arange(resp.numel()), resp)
    pos = torch.arange(int(resp.sum())) - (torch.cumsum(resp, 0) - resp)[sid]
    step["loss_mask"][(resp[sid] >= 4) & (pos >= 1) & (pos < 3)] = 0.0
    g = torch.Generator().manual_seed(100 + seed)
    returns = torch.randn(int(resp.sum()), generator=g)
    step["returns"] = returns
    step["values"] = returns + 0.3 * torch.randn(returns.shape, generator=g)
    return step


def around_predictions(data: dict, predictions: torch.Tensor, seed: int = 2) -> dict:
    """``data`` with old values within about the clip range of a model's ``predictions`` (within
    it or just past it) and returns further off (fp32), so both branches of the clipped loss occur."""
    g = torch.Generator().manual_seed(seed)
    v = predictions.detach().double()
    out = dict(data)
    out["values"] = (v + 0.2 * torch.randn(v.shape, generator=g, dtype=torch.float64)).float()
    out["returns"] = (v + torch.randn(v.shape, generator=g, dtype=torch.float64)).float()
    return out


def value_checkpoint(root, lm_dir: str, seed: int = 5) -> str:
    """The causal LM ``lm_dir`` as a critic HF directory with a random head (so every weight gets
    a gradient in the first step; a fresh critic's zero head leaves the backbone's at 0)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from rl_plugin.models.value_head import write_value_hf_dir

    out = Path(root) / f"value_{Path(lm_dir).name}_{seed}"
    if (out / "model.safetensors").is_file():
        return str(out)
    sd = {k: v for k, v in load_file(f"{lm_dir}/model.safetensors").items() if k.startswith("model.")}
    config = AutoConfig.from_pretrained(lm_dir)
    g = torch.Generator().manual_seed(seed)
    sd["score.weight"] = torch.randn(1, config.hidden_size, generator=g) / math.sqrt(config.hidden_size)
    write_value_hf_dir(str(out), sd, config, source_dir=lm_dir)
    return str(out)


def value_flags(ckpt: str, *extra: str, backend: str = "fsdp") -> list:
    return ["--train-backend", backend, "--hf-checkpoint", ckpt, "--seed", "7", *EXACT_SGD, *extra]


def value_backend(flags, *, world_size: int = 1, backend: str = "fsdp"):
    """A value backend (``TrainConfig.value_head``) of ``backend`` from flags."""
    from rl_plugin.configs.run import RunConfig

    if backend == "fsdp":
        from rl_plugin.backends.fsdp.backend import FSDPBackend

        train = RunConfig.from_args(parse(flags)).train
        return FSDPBackend.from_config(replace(train, value_head=True))
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    train = RunConfig.from_args(make_args(*flags, world_size=world_size)).train
    return MegatronBackend.from_config(replace(train, value_head=True))


def value_worker(rank, world, backend, ckpt, data, cases):
    """On every rank: for each case (name -> flags), a fresh value backend, this rank's DP share
    of ``data``, its forward-only values, one value step (exact SGD, lr 1) and the update (rank 0:
    every weight's change, HF names). Returns ``{case: dict(report, values, update)}``."""
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    n = data["total_lengths"].numel()
    out = {}
    for case, flags in cases.items():
        b = value_backend(value_flags(ckpt, *flags, backend=backend), world_size=world, backend=backend)
        dp, dp_rank = b.parallel_state.dp_size, b.parallel_state.dp_rank
        local = step_batch(data).select(split_samples_for_dp(n, dp)[dp_rank])
        w0 = b.export_hf_state_dict()
        values = b.compute_values(local)
        report = b.value_train_step(local, num_groups=3, value_clip=VALUE_CLIP)
        w1 = b.export_hf_state_dict()
        update = {k: w0[k] - w1[k] for k in w0} if rank == 0 else None
        out[case] = dict(report=report, values=values, update=update, dp_rank=dp_rank)
    return out


def alone_values(model, batch) -> torch.Tensor:
    """Each sample alone through an HF ``ForTokenClassification`` model (no packing, no mask): the
    head's output at the positions that predict its response tokens."""
    out, start = [], 0
    for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
        ids = batch.tokens[start : start + t]
        start += t
        scores = model(input_ids=ids.view(1, -1), use_cache=False).logits[0, :, 0]
        out.append(scores[t - r - 1 : t - 1])
    return torch.cat(out)


def reference_value_step(ckpt: str, data: dict, mode: str, value_clip: float = VALUE_CLIP):
    """(J, grad norm, values) by autograd through the unsharded HF value model, per sample, fp64
    loss from the formula and ``reference.objective``."""
    from rl_plugin.backends.fsdp.model import load_hf_model

    model = load_hf_model(ckpt, attn_implementation="eager", value_head=True)
    batch = step_batch(data)
    v = alone_values(model, batch).double()
    old, ret = batch.values.double(), batch.returns.double()
    vc = old + torch.clamp(v - old, -value_clip, value_clip)
    per_token = 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2)
    j = ref.objective(per_token, batch.loss_mask, batch.response_lengths.tolist(), batch.group_ids, mode, DIVISOR)
    j.backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return float(j.detach()), norm, v.detach()
