"""``--fp32-lm-head`` on the Megatron backend.

- bf16 model under DDP: logits are fp32 and equal an fp64 reference of the same projection; the
  weight gradient lands in the bf16 weight's fp32 ``main_grad`` and equals the fp64 reference
  ``R^T H``; after a real step the bf16 output weight has changed.
- Tied embeddings: the fp32 head must not drop the embedding-side gradient of the shared
  weight. The projection adds into ``main_grad`` and sets ``grad_added_to_main_grad``, which makes
  megatron-core 0.16.1's DDP hook skip ``param.grad`` (``distributed_data_parallel.py`` l. 437)
  unless the weight has ``zero_out_wgrad`` (set by megatron on the shared embedding weight). This
  pins that interplay: SGD updates with and without the fp32 head are equal (fp32 model).
- ``--sequence-parallel`` at TP = 2 (regression): the hidden-state gradient below the head is
  summed over TP once. The double-sum version (megatron's SP all-gather, whose backward
  reduce-scatters, then ``copy_to_tensor_model_parallel_region``, whose backward all-reduces)
  multiplied it by tp. Pinned on megatron-core's own mappings over 2 gloo ranks against the TP = 1
  reference, for the fp32 projection + vocab-parallel log-probs and for the fused head, with and
  without SP. (SP needs transformer-engine's norms for a whole model, absent on this CPU.)
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support import reference as ref
from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_LOSS_CORE, FP32_MODEL, FP64, tensor_within, within


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint, tiny_qwen2):
    return {
        "untied": tiny_qwen2,
        "tied": tiny_checkpoint(tie_word_embeddings=True),
    }


def _bf16_worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.forward import hidden_states_only, model_inputs, response_logits, unwrap
    from rl_plugin.loss import prepare_step
    from tests.support.megatron_common import make_args, synthetic_batch

    backend = MegatronBackend.from_args(
        make_args("--hf-checkpoint", hf_dir, "--bf16", "--fp32-lm-head", "--lr", "0.01")
    )
    model, gpt = backend.model, unwrap(backend.model)
    weight = gpt.output_layer.weight
    batch, groups = synthetic_batch(seed=7)
    mb = prepare_step(batch, backend.loss_config, backend.parallel_state, num_groups=groups).micro_batch(
        torch.arange(batch.num_samples)
    )

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
    bf16_rows = _bf16_rows_first(backend, mb)
    before = backend.export_hf_state_dict()["lm_head.weight"].clone()
    backend.train_step(batch, num_groups=groups)
    after = backend.export_hf_state_dict()["lm_head.weight"]
    return {
        "bf16_rows": bf16_rows,
        "weight_dtype": str(weight.dtype),
        "logits_dtype": str(rows.dtype),
        "main_grad_dtype": str(weight.main_grad.dtype),
        "logits_rel": float((rows.double() - ref_logits).norm() / ref_logits.norm()),
        "grad_rel": float((grad - ref_grad).norm() / ref_grad.norm()),
        "weight_changed": int((after != before).sum()),
        "weight_numel": after.numel(),
    }


class _RecordFP32Shapes(TorchDispatchMode):
    """How many fp32 tensors of each shape the ops return."""

    def __init__(self):
        super().__init__()
        self.shapes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32:
                self.shapes[tuple(o.shape)] = self.shapes.get(tuple(o.shape), 0) + 1
        return out


def _bf16_rows_first(backend, mb):
    """--bf16 without --fp32-lm-head (regression: the Float16Module's fp32 output held every
    position's logits, [1, s, V/tp] fp32, before the response rows were indexed). Unfused and
    fused paths: log-probs and the head/embedding gradients are bitwise those of the reference
    (the fp32 output, then the rows: upcasting bf16 is exact and the same kernels run), and no
    fp32 tensor spans every position's logits (and the fused path makes one fp32 hidden-state
    tensor fewer: the model's norms compute in fp32 themselves)."""
    from rl_plugin.backends.megatron.forward import model_inputs, response_log_probs, unwrap
    from rl_plugin.loss import ForwardOptions, log_probs_and_entropy
    from rl_plugin.loss.fused_head import fused_log_probs_and_entropy

    model, gpt, ps = backend.model, unwrap(backend.model), backend.parallel_state
    ids, pos, psp = model_inputs(mb, "thd")
    seq, vocab, hid = ids.numel(), gpt.output_layer.weight.shape[0], gpt.config.hidden_size
    r = torch.randn(mb.num_local_tokens, generator=torch.Generator().manual_seed(1))
    params = dict(gpt.named_parameters())
    watched = ("output_layer.weight", "embedding.word_embeddings.weight")

    def run(fn):
        model.zero_grad_buffer()
        with _RecordFP32Shapes() as rec:
            logp, ent = fn()
            ((logp * r).sum() + ent.sum()).backward()
        model.finish_grad_sync()
        return logp.detach(), {k: params[k].main_grad.clone() for k in watched}, rec.shapes

    def reference(fused):
        from rl_plugin.backends.megatron.forward import hidden_states_only

        if fused:
            with hidden_states_only(gpt):
                hidden = model(ids, pos, None, packed_seq_params=psp)  # fp32 [s, 1, H] (Float16Module)
            rows = hidden.transpose(0, 1).reshape(-1, hid)[mb.layout.logit_index]
            return fused_log_probs_and_entropy(rows, gpt.output_layer.weight, mb.targets, chunk_size=1024)
        logits = model(ids, pos, None, packed_seq_params=psp)  # fp32 [1, s, V]
        return log_probs_and_entropy(logits.reshape(-1, vocab)[mb.layout.logit_index], mb.targets, chunk_size=1024)

    out = {}
    for fused in (False, True):
        got = run(
            lambda fused=fused: response_log_probs(
                model,
                mb,
                ForwardOptions(temperature=1.0, chunk_size=1024, with_entropy=True),
                ps,
                qkv_format="thd",
                fp32_lm_head=False,
                fused=fused,
            )
        )
        want = run(lambda fused=fused: reference(fused))
        full = {(1, seq, vocab), (seq, vocab), (seq, 1, vocab)}
        out[fused] = {
            "logp_equal": bool(torch.equal(got[0], want[0])),
            "grads_equal": {k: bool(torch.equal(got[1][k], want[1][k])) for k in watched},
            "full_fp32": sorted(full & set(got[2])),
            "ref_full_fp32": sorted(full & set(want[2])),
            "hidden_fp32": (got[2].get((seq, 1, hid), 0), want[2].get((seq, 1, hid), 0)),
        }
    return out


@pytest.fixture(scope="module")
def bf16_run(run_world, dirs):
    return run_world(_bf16_worker, 1, dirs["untied"])[0]


def test_bf16_logits_indexed_before_upcast(bf16_run):
    for fused, res in bf16_run["bf16_rows"].items():
        assert res["logp_equal"] and all(res["grads_equal"].values()), (fused, res)
        if not fused:
            assert res["full_fp32"] == [], res  # no fp32 logits over every position
            assert res["ref_full_fp32"], res  # the reference's fp32 output is one (the check sees it)
        else:
            assert res["hidden_fp32"][0] < res["hidden_fp32"][1], res  # the Float16Module's fp32 copy is gone


def test_fp32_head_bf16_weight_gets_fp32_gradient(bf16_run):
    out = bf16_run
    assert out["weight_dtype"] == "torch.bfloat16" and out["logits_dtype"] == "torch.float32"
    assert out["main_grad_dtype"] == "torch.float32"
    assert out["logits_rel"] < FP32_MODEL, out  # fp32 accumulation of exact bf16 products vs fp64
    assert out["grad_rel"] < FP32_MODEL, out
    assert out["weight_changed"] > out["weight_numel"] // 2, out


def _tied_worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args, synthetic_batch

    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, *EXACT_SGD))
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


def test_fp32_head_keeps_tied_embedding_gradient(run_world, dirs):
    updates = run_world(_tied_worker, 1, dirs["tied"])[0]
    (u_ref, n_ref), (u_fp32, n_fp32) = updates[False], updates[True]
    assert float(u_ref.norm()) > 0
    assert float((u_fp32 - u_ref).norm() / u_ref.norm()) < FP32_MODEL  # fp32 weights: the same step, another head
    assert within(n_fp32, n_ref, rtol=FP32_MODEL)


SP_SEQ, SP_H, SP_V = 8, 6, 11  # sequence (split 4 + 4 under SP), hidden, vocab (uneven shards 6 + 5)
SP_INDEX = torch.tensor([1, 2, 3, 5, 6, 7])  # the response rows (positions on both SP shards)


def _sp_data(dtype):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(SP_SEQ, 1, SP_H, generator=g, dtype=torch.float64)
    weight = torch.randn(SP_V, SP_H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, SP_V, (SP_INDEX.numel(),), generator=g)
    a, b = torch.randn(2, SP_INDEX.numel(), generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), targets, a, b


def _sp_reference(dtype):
    """TP = 1, no SP: d/dhidden of sum(a logp + b entropy) through the full head."""
    hidden, weight, targets, a, b = _sp_data(torch.float64)
    leaf = hidden.clone().requires_grad_(True)
    rows = leaf.transpose(0, 1).reshape(-1, SP_H)[SP_INDEX]
    logp, ent = ref.log_softmax_entropy(rows @ weight.t(), targets)
    ((logp * a).sum() + (ent * b).sum()).backward()
    return leaf.grad


def _sp_worker(rank, world):
    import torch.distributed as dist

    from rl_plugin.backends.megatron.forward import response_rows
    from rl_plugin.loss import fp32_output_projection, log_probs_and_entropy
    from rl_plugin.loss.fused_head import fused_log_probs_and_entropy

    # megatron's mappings allocate on torch.cuda.current_device(): the CPU here (what the
    # backend's cpu_shim does, without importing the rest of megatron for it)
    torch.cuda.current_device = lambda: "cpu"
    tp = dist.new_group(list(range(world)))
    lo, hi = [(0, 6), (6, SP_V)][rank]
    out = {}
    for sp in (True, False):
        for fused in (False, True):
            dtype = torch.float64 if fused else torch.float32  # the fp32 projection computes in fp32
            hidden, weight, targets, a, b = _sp_data(dtype)
            if sp:
                hidden = hidden[rank * SP_SEQ // world : (rank + 1) * SP_SEQ // world]  # this rank's sequence shard
            leaf = hidden.clone().requires_grad_(True)
            rows = response_rows(leaf, SP_INDEX, sequence_parallel=sp, grad_summed_by_caller=fused, tp_group=tp)
            if fused:
                logp, ent = fused_log_probs_and_entropy(
                    rows, weight[lo:hi], targets, tp_group=tp, vocab_start=lo, chunk_size=4, reduce_hidden_grad=not sp
                )
            else:
                logits = fp32_output_projection(rows, weight[lo:hi])
                logp, ent = log_probs_and_entropy(logits, targets, tp_group=tp, vocab_start=lo, chunk_size=4)
            ((logp.double() * a).sum() + (ent.double() * b).sum()).backward()
            out[(sp, fused)] = leaf.grad.double()
    return out


def test_sequence_parallel_fp32_head_sums_hidden_grad_over_tp_once(run_world):
    want = _sp_reference(torch.float64)
    for rank, out in enumerate(run_world(_sp_worker, 2)):
        for (sp, fused), got in out.items():
            w = want[rank * SP_SEQ // 2 : (rank + 1) * SP_SEQ // 2] if sp else want
            # fused: fp64 throughout. Unfused: the fp32 projection and log-softmax of O(5) logits
            # (|h| |w| over H = 6 terms), so fp32 rounding scaled by those logits.
            tol = FP64 if fused else FP32_LOSS_CORE
            assert tensor_within(got, w, rtol=tol, scale=10.0), (
                rank,
                sp,
                fused,
                float((got - w).abs().max()),
                float((got / w).nanmean()),
            )
