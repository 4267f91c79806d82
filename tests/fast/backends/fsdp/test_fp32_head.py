"""``--fp32-lm-head`` on the FSDP backend: fp32 accumulation and logits, and the gradient reaches
the (bf16) weight, tied embeddings included.

- Module level: with bf16 hidden states and a bf16 weight, the head's logits are fp32 and equal an
  fp64 matmul of the same bf16 values (a bf16 ``nn.Linear`` is ~1e-2 off), and the weight's
  gradient equals the fp64 reference ``G^T h`` up to its final bf16 rounding.
- Whole model, fp32: installing the head changes no gradient (same grads as HF's own head), and a
  tied embedding stays the same Parameter.
- FSDP2, --bf16 --fp32-lm-head, tied embeddings: one step changes the embedding rows of tokens
  that are never INPUT (only predicted), which only the head's gradient can reach; the loss is
  the fp32 run's within bf16 error; the tied fp32 step has the same loss and grad norm at DP=1 and DP=2. (Regression: ``export_hf_state_dict`` returned the live
  parameters at DP=1, so a dict taken before a step silently changed with it; it now copies.)
"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.backends.fsdp.model import FP32LMHead, install_fp32_lm_head, load_hf_model
from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch
from tests.support.tolerance import BF16_MODEL, BF16_ROUND, FP32_MODEL, tensor_within, within


def test_head_fp32_logits_and_weight_grad_match_fp64():
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 97, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(97, 48, generator=g))
    head = FP32LMHead(linear)
    hidden = torch.randn(5, 48, generator=g).to(torch.bfloat16)
    upstream = torch.randn(5, 97, generator=g, dtype=torch.float64)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and head.weight is linear.weight
    want = hidden.double() @ linear.weight.detach().double().t()
    assert tensor_within(logits.detach(), want, rtol=FP32_MODEL)  # bf16 inputs are exact in fp32: one fp32 contraction
    bf16_err = float((linear(hidden).detach().double() - want).abs().max() / want.abs().max())
    assert bf16_err > 1e-3  # what the fp32 head avoids
    (logits.double() * upstream).sum().backward()
    grad_want = upstream.t() @ hidden.double()
    assert linear.weight.grad.dtype == torch.bfloat16
    assert tensor_within(linear.weight.grad, grad_want, rtol=BF16_ROUND)  # fp32 accumulation, one rounding to bf16


@pytest.mark.parametrize("tied", [False, True])
def test_installed_head_keeps_ties_and_gradients(tiny_checkpoint, tied):
    ckpt = tiny_checkpoint(tie_word_embeddings=tied)
    batch = step_batch(make_step(2))
    grads = []
    for fp32_head in (False, True):
        torch.manual_seed(0)
        model = load_hf_model(ckpt, attn_implementation="eager")
        if fp32_head:
            install_fp32_lm_head(model)
            assert isinstance(model.lm_head, FP32LMHead)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        logits = model(input_ids=batch.tokens.view(1, -1), use_cache=False).logits
        torch.log_softmax(logits.float(), -1)[0, torch.arange(10), batch.tokens[1:11]].sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert tensor_within(grads[1][name], g, rtol=FP32_MODEL), name


def step_bf16(rank, world, ckpt, bf16):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    flags = ["--fp32-lm-head", "--bf16"] if bf16 else []
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, "--micro-batch-size", "3", "--lr", "0.01", *flags)))
    dtypes = []
    backend.model.lm_head.register_forward_hook(lambda m, i, o: dtypes.append((i[0].dtype, o.dtype)))
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    batch = step_batch(make_step(4)).select(split_samples_for_dp(9, world)[rank])
    before = backend.export_hf_state_dict()
    kept = {k: v.clone() for k, v in before.items()}
    report = backend.train_step(batch, num_groups=3)
    for k, v in before.items():  # the export is a copy, not the live parameter
        assert torch.equal(v, kept[k]), k
    return dict(
        report=report,
        before=before,
        after=backend.export_hf_state_dict(),
        dtypes=dtypes,
        input_ids=batch.tokens.unique(),
    )


def test_fsdp_bf16_fp32_head_gradient_reaches_tied_weight(run_world, tiny_checkpoint):
    ckpt = tiny_checkpoint(tie_word_embeddings=True)
    bf16 = run_world(step_bf16, 1, ckpt, True)[0]
    fp32 = run_world(step_bf16, 1, ckpt, False)[0]
    fp32_dp2 = run_world(step_bf16, 2, ckpt, False)[0]  # the tied weight is sharded over 2 ranks
    assert set(bf16["dtypes"]) == {(torch.bfloat16, torch.float32)}  # bf16 compute, fp32 logits
    name = "model.embed_tokens.weight"
    delta = (bf16["after"][name] - bf16["before"][name]).abs().max(1).values
    never_input = torch.ones(delta.numel(), dtype=torch.bool)
    never_input[bf16["input_ids"]] = False
    assert bool(never_input.any())
    assert bool((delta[never_input] > 0).all())  # reached only through the tied head
    step = make_step(4)  # J's per-token terms are -A * exp(logp - old): their magnitude bounds J's rounding
    scale = float(step["advantages"].abs().max()) * float(step["old_log_probs"].abs().max())
    assert within(bf16["report"]["loss"], fp32["report"]["loss"], rtol=BF16_MODEL, scale=scale)
    assert within(bf16["report"]["grad_norm"], fp32["report"]["grad_norm"], rtol=BF16_MODEL)
    assert within(fp32_dp2["report"]["loss"], fp32["report"]["loss"], rtol=FP32_MODEL, scale=scale)
    assert within(fp32_dp2["report"]["grad_norm"], fp32["report"]["grad_norm"], rtol=FP32_MODEL)
