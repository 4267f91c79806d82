"""LoRA on the Megatron backend (issue 34): the same adapters, J and adapter gradients on every
layout, a frozen base, and the fused-layout placement against an unfused HF reference.

One spawn per layout (TP1 on one rank; TP2, DP2 with the distributed optimizer, PP2 on two), on
the tiny Qwen2 (4 heads in 2 query groups, so TP2 splits ``linear_qkv`` by group; q/k/v biases).
Inside each, with ``--lora-rank 4 --lora-alpha 8 --target-modules all-linear``:

- at the start (B = 0) the adapted forward equals the adapters-off forward bitwise (``s * B A x``
  adds exact zeros); the adapters-off forward (the KL reference) stays the base's once B != 0;
- the DDP grad buffers and the optimizer hold exactly the adapters (frozen weights: no buffer, no
  state);
- seeded random adapters (B != 0, so A gets a gradient too) are loaded by canonical name, one
  step of exact SGD (lr 1: the update IS the applied gradient) runs a PPO-clip + KL(k1) loss over
  several micro-batches (the KL reference is the actor with its adapters off);
- the base weights are bitwise unchanged after the step.

J, the grad norm and every adapter's gradient (gathered to full, canonical names) agree with TP1
within ``tolerance.FP32_MODEL``, as the full-model parity tests (``parity/test_pipeline.py``).

Placement: the merged export (``W + s B A`` through megatron's fused layout, TP-gathered and split
by mbridge; the weight sync's full-weight stream gives the same tensors on every layout) equals
the merge done on the HF tensors directly, and the adapted megatron forward
equals a plain HF forward of those directly merged weights (``fsdp_common.alone_log_probs``).
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, max_abs, within

RANK, ALPHA = 4, 8.0
LORA = ("--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--target-modules", "all-linear")
LOSS = ("--eps-clip", "0.2", "--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "k1")
LOSS += ("--n-samples-per-prompt", "4", "--loss-aggregation", "token_mean")


def random_adapters(specs) -> dict:
    """Seeded full adapters for ``specs`` (name -> meta tensor), each from its own name's seed."""
    out = {}
    for name, meta in specs.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = 0.2 * torch.randn(meta.shape, generator=g)
    return out


def _ddp_holds_only_adapters(backend):
    """Every DDP buffer's parameters are adapters and every adapter is in one; the same for the
    optimizer's groups. Returns (buffer numel unpadded, adapter numel)."""
    from rl_plugin.backends.megatron.chunks import chunks_of
    from rl_plugin.backends.megatron.compat.dist_optimizer import optimizers
    from rl_plugin.backends.megatron.lora_model import local_adapters

    adapters = {id(p): p for _, p, _, _ in local_adapters(backend.model)}
    in_buffers = {id(p) for ddp in chunks_of(backend.model) for buf in ddp.buffers for p in buf.params}
    assert in_buffers == set(adapters), "DDP grad buffers hold other parameters than the adapters"
    numel = sum(buf.numel_unpadded for ddp in chunks_of(backend.model) for buf in ddp.buffers)
    want = sum(p.numel() for p in adapters.values())
    assert numel == want, (numel, want)
    for opt in optimizers(backend.optimizer):
        groups = getattr(opt, "model_float16_groups", None) or []
        fp32 = getattr(opt, "model_fp32_groups", None) or []
        params = [p for g in groups + fp32 for p in g] or [p for g in opt.param_groups for p in g["params"]]
        assert {id(p) for p in params} <= set(adapters), "the optimizer holds a frozen weight"
    frozen = [n for ddp in chunks_of(backend.model) for n, p in ddp.named_parameters() if p.requires_grad]
    assert all(".lora." in n for n in frozen), frozen
    return numel, want


def _adapters_now(backend) -> dict:
    """The streamed adapters, copied (a stream's tensors are valid until the weights change)."""
    return {k: v.clone() for k, v in backend.stream_lora_adapters()}


def lora_worker(rank, world, tp, pp, hf_dir, extra=(), save_dir=None, load_dir=None):
    from dataclasses import replace

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.loss.micro_batch_plan import plan_micro_batches
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    flags = ["--hf-checkpoint", hf_dir, "--tensor-model-parallel-size", str(tp)]
    optimizer = () if "--optimizer" in extra else EXACT_SGD
    flags += ["--pipeline-model-parallel-size", str(pp), *optimizer, *LORA, *LOSS, *extra]
    backend = MegatronBackend.from_args(make_args(*flags, world_size=world))
    ps = backend.parallel_state
    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    local = dp_shard(batch, ps.dp_size, ps.dp_rank)

    adapters = random_adapters(backend.lora_adapter_specs())
    base_logp = backend.compute_log_probs(local, role="ref")
    if "--lora-adapter-path" in extra:  # started from a PEFT file of the same adapters
        start = _adapters_now(backend)  # global rank 0's; the other ranks get nothing
        assert rank or set(start) == set(adapters) and all(torch.equal(start[k], adapters[k]) for k in adapters)
    else:
        init = backend.compute_log_probs(local)
        assert torch.equal(init, base_logp), "B = 0: the adapted forward is not the base forward bitwise"
    counts = _ddp_holds_only_adapters(backend)

    backend.load_lora_adapters(adapters)
    assert torch.equal(backend.compute_log_probs(local, role="ref"), base_logp), "the reference is not the base"
    a0 = _adapters_now(backend)
    base0 = backend.export_base_state_dict()
    merged = backend.export_hf_state_dict()
    streamed = {k: v.clone() for k, v in backend.stream_hf_weights()}  # the full-weight sync's merged fallback
    assert rank or (set(streamed) == set(merged) and all(torch.equal(streamed[k], merged[k]) for k in merged))
    assert rank or set(backend.hf_weight_specs()) == set(merged)
    logp = backend.compute_log_probs(local)
    step = with_old_log_probs(local, logp)
    step = replace(step, ref_log_probs=backend.compute_log_probs(local, role="ref"))
    split = plan_micro_batches(step, micro_batch_size=1, max_tokens_per_gpu=24, dp_group=ps.dp_group)
    report = backend.train_step(step, num_groups=num_groups, micro_batches=split)
    a1 = _adapters_now(backend)
    logp_after = backend.compute_log_probs(local)
    base1 = backend.export_base_state_dict()
    assert set(base0) == set(base1) and all(torch.equal(base0[k], base1[k]) for k in base0), "a base weight moved"
    loaded = None
    if save_dir is not None:
        backend.save_checkpoint(save_dir, step=1)
        backend.save_hf(save_dir + "_peft")  # --save-hf with LoRA: a PEFT adapter directory
    if load_dir is not None:
        backend.load_checkpoint(load_dir)
        loaded = _adapters_now(backend)
    if rank:
        return None
    dtype = torch.bfloat16 if "--bf16" in extra else torch.float32  # the adapters are the model's dtype
    bad = sorted(set(a0) ^ set(adapters)) or [k for k in a0 if not torch.equal(a0[k], adapters[k].to(dtype).float())]
    assert not bad, ("adapters not loaded as given", bad[:4], len(bad))
    grads = {k: a0[k] - a1[k] for k in a0}
    scale = max_abs(local.advantages) * max(1.0, max_abs(logp))
    return dict(
        report=report,
        grads=grads,
        after=a1,
        logp=logp,
        logp_after=logp_after,
        scale=scale,
        merged=merged,
        base=base0,
        adapters=adapters,
        counts=counts,
        loaded=loaded,
    )


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora_ckpt"))


@pytest.fixture(scope="module")
def runs(run_world, tiny_qwen2, ckpt_dir, tmp_path_factory):
    """layout -> rank 0's result. TP1 saves its adapter checkpoint after the step; TP2 loads it;
    DP2 starts from TP1's adapters written as a PEFT adapter file (``--lora-adapter-path``)."""
    from safetensors.torch import save_file

    from rl_plugin.lora.names import peft_file_name
    from rl_plugin.lora.targets import ALL_LINEAR

    hf = str(tiny_qwen2)
    out = {"tp1": run_world(lora_worker, 1, 1, 1, hf, (), ckpt_dir)[0]}
    out["tp2"] = run_world(lora_worker, 2, 2, 1, hf, (), None, ckpt_dir)[0]
    peft = tmp_path_factory.mktemp("peft_adapter")  # DP2 starts from TP1's adapters as a PEFT file
    save_file(
        {peft_file_name(k): v.contiguous() for k, v in out["tp1"]["adapters"].items()},
        peft / "adapter_model.safetensors",
    )
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(ALL_LINEAR), "bias": "none"}
    (peft / "adapter_config.json").write_text(json.dumps(config))
    out["dp2"] = run_world(lora_worker, 2, 1, 1, hf, ("--lora-adapter-path", str(peft)))[0]
    out["pp2"] = run_world(lora_worker, 2, 1, 2, hf)[0]
    return out


DIST_OPT = ("--use-distributed-optimizer", "--bf16", "--optimizer", "adam", "--lr", "1e-2")


@pytest.fixture(scope="module")
def dist_opt(run_world, tiny_qwen2, tmp_path_factory):
    """DP2 x bf16 with the distributed optimizer (Adam, which it requires): saves its adapter +
    Adam checkpoint after the step and loads it back."""
    ck = str(tmp_path_factory.mktemp("lora_distopt"))
    return run_world(lora_worker, 2, 1, 1, str(tiny_qwen2), DIST_OPT, ck, ck)[0]


@pytest.mark.parametrize("layout", ["tp2", "dp2", "pp2"])
def test_lora_parity_across_layouts(runs, layout):
    """J, grad norm and every adapter gradient (full, canonical names) equal TP1's."""
    want, got = runs["tp1"], runs[layout]
    assert set(got["grads"]) == set(want["grads"])
    assert within(got["report"]["loss"], want["report"]["loss"], rtol=FP32_MODEL, scale=want["scale"])
    assert within(got["report"]["grad_norm"], want["report"]["grad_norm"], rtol=FP32_MODEL)
    num = sum(float(((got["grads"][k] - g) ** 2).sum()) for k, g in want["grads"].items())
    den = sum(float((g**2).sum()) for g in want["grads"].values())
    assert (num / den) ** 0.5 < FP32_MODEL, (num / den) ** 0.5
    for name, g in want["grads"].items():  # every adapter moved, A and B alike (B != 0 at the start)
        assert float(g.abs().max()) > 0, name


def test_lora_buffers_are_the_adapters(runs, dist_opt):
    """The DDP buffers' numel is the adapters' numel (frozen weights: no grad buffer), per layout;
    at TP2 each rank holds half of the split tensors and the whole of the replicated ones."""
    numel, want = runs["tp1"]["counts"]
    assert numel == want == sum(t.numel() for t in runs["tp1"]["adapters"].values())
    assert runs["tp2"]["counts"][0] < want and runs["dp2"]["counts"][0] == want
    assert dist_opt["counts"] == (want, want)


def test_lora_distributed_optimizer_bf16(runs, dist_opt):
    """Under bf16 and the distributed optimizer: J is TP1's (within bf16 rounding), the base stays
    bitwise (asserted in the worker), every adapter moved, and the adapter + Adam checkpoint loads
    back to the same adapters."""
    from tests.support.tolerance import BF16_MODEL

    want = runs["tp1"]
    assert within(dist_opt["report"]["loss"], want["report"]["loss"], rtol=BF16_MODEL, scale=want["scale"])
    assert all(float(g.abs().max()) > 0 for g in dist_opt["grads"].values())
    loaded, after = dist_opt["loaded"], dist_opt["after"]
    assert set(loaded) == set(after) and all(torch.equal(loaded[k], after[k]) for k in after)


def _merge_on_hf(base, adapters, scaling):
    """``W + s B A`` on the HF tensors, projection by projection (no megatron layout)."""
    out = dict(base)
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            path = name[: -len(".lora_A.weight")]
            b, a = adapters[f"{path}.lora_B.weight"].double(), adapters[name].double()
            out[f"{path}.weight"] = (base[f"{path}.weight"].double() + scaling * b @ a).float()
    return out


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_fused_placement_equals_unfused_reference(runs, tiny_qwen2, layout):
    """The merged export equals the merge on HF tensors, and the adapted forward equals a plain HF
    forward of those merged weights (q/k/v interleaved per query group, gate/up per TP shard)."""
    from transformers import AutoModelForCausalLM

    from tests.support.fsdp_common import alone_log_probs
    from tests.support.megatron_common import synthetic_batch

    run = runs[layout]
    reference = _merge_on_hf(run["base"], run["adapters"], ALPHA / RANK)
    assert set(run["merged"]) == set(reference)
    for k, w in reference.items():
        assert torch.allclose(run["merged"][k], w, rtol=0, atol=FP32_MODEL * max(1.0, max_abs(w))), k
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    batch, _ = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    with torch.no_grad():
        want = alone_log_probs(model, batch).float()
    assert torch.allclose(run["logp"], want, rtol=0, atol=FP32_MODEL * max(1.0, max_abs(want)) * 4)


def test_adapter_checkpoint_resumes_on_another_layout(runs, ckpt_dir):
    """TP1's adapter-only checkpoint (after its step) loads at TP2 to the same adapters, bitwise;
    the checkpoint holds adapters only (no base weight)."""
    import torch.distributed.checkpoint as dcp

    loaded, want = runs["tp2"]["loaded"], runs["tp1"]["after"]
    assert set(loaded) == set(want) and all(torch.equal(loaded[k], want[k]) for k in want)
    keys = dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]


def alpha_load_error(rank, world, hf_dir, load_dir):
    """A backend with another --lora-alpha than the checkpoint's: its load's error (None: loaded)."""
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    other = ("--lora-rank", str(RANK), "--lora-alpha", str(2 * ALPHA), "--target-modules", "all-linear")
    backend = MegatronBackend.from_args(
        make_args("--hf-checkpoint", hf_dir, *EXACT_SGD, *other, *LOSS, world_size=world)
    )
    try:
        backend.load_checkpoint(load_dir)
    except ValueError as exc:
        return str(exc)
    return None


def test_adapter_checkpoint_refuses_another_lora_alpha(runs, run_world, tiny_qwen2, ckpt_dir):
    """TP1's checkpoint (--lora-alpha 8) into a run with --lora-alpha 16: refused naming both values,
    by the one check both backends run (``checkpoint.lora_meta``; issue 44 item 4)."""
    msg = run_world(alpha_load_error, 1, str(tiny_qwen2), ckpt_dir)[0]
    assert msg is not None, "a resume with another --lora-alpha was accepted"
    assert "--lora-alpha 8 in the checkpoint, 16 in this run" in msg, msg
    assert "Fix: resume with the checkpoint's --lora-rank 4 --lora-alpha 8" in msg, msg


def test_save_hf_writes_a_peft_dir_peft_loads(runs, tiny_qwen2, ckpt_dir):
    """``save_hf`` with LoRA (TP1, after its step): a PEFT directory that
    ``PeftModel.from_pretrained`` loads on the HF base, giving the trainer's log-probs; the
    checkpoint beside it carries the shared ``lora.json`` (adapter shape + base identity)."""
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.support.fsdp_common import alone_log_probs
    from tests.support.megatron_common import synthetic_batch

    assert (Path(ckpt_dir) / "lora.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ckpt_dir + "_peft").eval()
    batch, _ = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    with torch.no_grad():
        want = alone_log_probs(model, batch).float()
    got = runs["tp1"]["logp_after"]
    assert torch.allclose(got, want, rtol=0, atol=FP32_MODEL * max(1.0, max_abs(want)) * 4)
