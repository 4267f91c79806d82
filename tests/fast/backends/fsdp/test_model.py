"""Regression: the FSDP backend trained with the checkpoint's dropout while the old log-probs ran
in eval mode, so the PPO ratio was not 1 at step 0. ``load_hf_model`` now turns every dropout
off (as the Megatron backend does): a train-mode forward equals the eval-mode one bitwise."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.backends.fsdp.model import load_hf_model
from rl_plugin.loss import LossConfig, prepare_step
from rl_plugin.parallel import ParallelState
from tests.support.fsdp_common import VOCAB, alone_log_probs, make_step, step_batch


def _checkpoint(tmp_path, family: str) -> str:
    """A tiny seeded checkpoint whose config asks for 0.1 dropout everywhere it can."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from rl_plugin.models.tiny import tiny_config

    if family == "gpt2":  # three dropout fields (attention, residual, embedding)
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        cfg = tiny_config("qwen2")
        cfg.attention_dropout = 0.1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path / family
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_fsdp_dropout_forced_off_so_step0_ratio_is_one(tmp_path, family):
    model = load_hf_model(_checkpoint(tmp_path, family), attn_implementation="eager")
    assert all(
        getattr(model.config, f, 0.0) == 0.0 for f in ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
    )
    batch = step_batch(make_step(0))
    with torch.no_grad():
        model.eval()
        old = alone_log_probs(model, batch)  # the old-log-prob pass (eval mode)
        model.train()
        new = alone_log_probs(model, batch)  # the training forward (train mode)
    assert torch.equal(new, old)  # same code, same data, no dropout: bitwise
    # the step's ratio metrics at step 0: every ratio exactly 1
    full = old  # fp64; alone_log_probs skips empty responses, which hold no token
    batch.old_log_probs = full
    ctx = prepare_step(batch, LossConfig(), ParallelState.single())
    ctx.loss(full, None, ctx.micro_batch(torch.arange(batch.num_samples)))
    report = ctx.finish()
    assert report["tokens"] > 0 and report["ratio_sum"] == report["tokens"]  # sum of m * 1 over tokens: exact
    # ratio_mean is the sample mean of r = 1: the fraction of samples with a masked-in token
    # (make_step has an empty and an all-masked one), up to fp64 rounding of ~30 weights
    nonempty = float((ctx.counts.sample_tokens > 0).sum()) / ctx.counts.num_samples
    assert abs(report["ratio_mean"] - nonempty) < 1e-12
