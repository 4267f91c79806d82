"""``--fp32-lm-head`` on the Megatron backend.

- bf16 model under DDP: logits are fp32 and equal an fp64 reference of the same projection; the
  weight gradient lands in the bf16 weight's fp32 ``main_grad`` and equals the fp64 reference
  ``R^T H``; after a real step the bf16 output weight has changed.
- Tied embeddings: the fp32 head must not drop the embedding-side gradient of the shared
  weight. The projection adds into ``main_grad`` and sets ``grad_added_to_main_grad``, which makes
  megatron-core 0.16.1's DDP hook skip ``param.grad`` (``distributed_data_parallel.py`` l. 437)
  unless the weight has ``zero_out_wgrad`` (set by megatron on the shared embedding weight). This
  pins that interplay: SGD updates with and without the fp32 head are equal (fp32 model).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.fast.harness import run_world
from tests.fast.tolerance import FP32_MODEL, within


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("tiny_fp32head")
    return {
        "untied": str(make_tiny_hf_checkpoint(root / "untied", "qwen2")),
        "tied": str(make_tiny_hf_checkpoint(root / "tied", "qwen2", tie_word_embeddings=True)),
    }


def _bf16_worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.forward import hidden_states_only, model_inputs, response_logits, unwrap
    from tests.fast.megatron_common import make_args, synthetic_batch
    from rl_plugin.loss import prepare_step

    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, "--bf16", "--fp32-lm-head", "--lr", "0.01"))
    model, gpt = backend.model, unwrap(backend.model)
    weight = gpt.output_layer.weight
    batch, groups = synthetic_batch(seed=7)
    mb = prepare_step(batch, backend.loss_config, backend.parallel_state, num_groups=groups).micro_batch(torch.arange(batch.num_samples))

    model.zero_grad_buffer()
    rows = response_logits(model, mb, qkv_format="thd", fp32_lm_head=True)
    ids, pos, psp = model_inputs(mb, "thd")
    with torch.no_grad(), hidden_states_only(gpt):
        hidden = model(ids, pos, None, packed_seq_params=psp)
    h64 = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[mb.layout.logit_index].double()
    w64 = weight.detach().double()
    ref_logits = h64 @ w64.t()
    r = torch.randn(rows.shape, generator=torch.Generator().manual_seed(0))
    (rows * r).sum().backward()
    model.finish_grad_sync()
    ref_grad = r.double().t() @ h64
    grad = weight.main_grad.double()
    before = backend.export_hf_state_dict()["lm_head.weight"].clone()
    backend.train_step(batch, num_groups=groups)
    after = backend.export_hf_state_dict()["lm_head.weight"]
    return {
        "weight_dtype": str(weight.dtype), "logits_dtype": str(rows.dtype), "main_grad_dtype": str(weight.main_grad.dtype),
        "logits_rel": float((rows.double() - ref_logits).norm() / ref_logits.norm()),
        "grad_rel": float((grad - ref_grad).norm() / ref_grad.norm()),
        "weight_changed": int((after != before).sum()), "weight_numel": after.numel(),
    }


def test_fp32_head_bf16_weight_gets_fp32_gradient(dirs):
    out = run_world(_bf16_worker, 1, dirs["untied"])[0]
    assert out["weight_dtype"] == "torch.bfloat16" and out["logits_dtype"] == "torch.float32"
    assert out["main_grad_dtype"] == "torch.float32"
    assert out["logits_rel"] < FP32_MODEL, out  # fp32 accumulation of exact bf16 products vs fp64
    assert out["grad_rel"] < FP32_MODEL, out
    assert out["weight_changed"] > out["weight_numel"] // 2, out


def _tied_worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.fast.megatron_common import make_args, synthetic_batch

    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, "--optimizer", "sgd", "--sgd-momentum", "0",
                                                  "--lr", "1.0", "--clip-grad", "0"))
    ckpt = tempfile.mkdtemp(prefix="mgt_tied_")
    backend.save_checkpoint(ckpt, step=0)
    w0 = backend.export_hf_state_dict()["model.embed_tokens.weight"].clone()
    batch, groups = synthetic_batch(seed=11)
    updates = {}
    for fp32_head in (False, True):
        backend.load_checkpoint(ckpt)
        backend.fp32_lm_head = fp32_head
        report = backend.train_step(batch, num_groups=groups)
        updates[fp32_head] = (backend.export_hf_state_dict()["model.embed_tokens.weight"] - w0, report["grad_norm"])
    return updates


def test_fp32_head_keeps_tied_embedding_gradient(dirs):
    updates = run_world(_tied_worker, 1, dirs["tied"])[0]
    (u_ref, n_ref), (u_fp32, n_fp32) = updates[False], updates[True]
    assert float(u_ref.norm()) > 0
    assert float((u_fp32 - u_ref).norm() / u_ref.norm()) < FP32_MODEL  # fp32 weights: the same step, another head
    assert within(n_fp32, n_ref, rtol=FP32_MODEL)
