"""LoRA weight sync into the hf engine: adapters only travel, the engine merges from the base it
kept, and its log-probs equal the trainer's.

One gloo process runs the real FSDP backend with LoRA, the real publisher (shared memory, small
buckets so a module's A and B land in different buckets) and an ``HFEngine``: after each of three
train steps + syncs, (1) the bytes that travelled are the adapters' (B, A of every targeted linear;
no base tensor), (2) ``--check-weight-sync``'s fingerprints of what travelled match the engine's
read-back, (3) the engine's sampled log-probs equal the trainer's recomputation at rounding, and
(4) the engine's weights are bitwise those of a fresh engine given only the last adapters (the
merge never accumulates across syncs). A second test alternates two adapters 20 times.
"""

from __future__ import annotations

import torch

from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.05", "--micro-batch-size", "3"]
SCALING = 8 / 4


def engine_batch(gens):
    from rl_plugin.loss import StepBatch

    tokens = torch.tensor([t for g in gens for t in g.prompt_ids + g.response_ids])
    resp = torch.tensor([len(g.response_ids) for g in gens])
    total = torch.tensor([len(g.prompt_ids) + len(g.response_ids) for g in gens])
    r = int(resp.sum())
    return StepBatch(
        tokens=tokens,
        total_lengths=total,
        response_lengths=resp,
        loss_mask=torch.ones(r),
        advantages=torch.zeros(r),
        group_ids=torch.arange(len(gens)),
    )


def worker(rank, world, ckpt):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine
    from rl_plugin.weight_sync import SyncRequest, WeightPublisher, WeightReceiver, load_sync, node_id
    from rl_plugin.weight_sync.fingerprint import compare_fingerprints

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *LORA)))
    engine = HFEngine(ckpt, lora_scaling=SCALING)
    publisher, receiver = WeightPublisher("shared_memory"), WeightReceiver()
    request = SyncRequest(buffer_bytes=3000, transport="shared_memory", engine_nodes=(node_id(),), fingerprint=True)
    adapter_bytes = sum(t.numel() * 4 for t in backend.lora_adapter_specs().values())
    model_bytes = sum(v.numel() * 4 for v in engine.model.state_dict().values())
    prompts = [[5, 9, 17, 3], [5, 9, 17, 3], [40, 2, 77], [11, 12, 13, 14, 15]]
    out = []
    try:
        for k in range(3):
            backend.train_step(step_batch(make_step(k, with_ref=False)), num_groups=3)
            handle = publisher.publish_stream(backend.lora_adapter_specs(), backend.stream_lora_adapters(), request)
            stats = load_sync(engine, receiver, handle)
            compare_fingerprints(handle.fingerprint, stats["fingerprint"])  # raises on a mismatch
            gens = engine.generate(prompts, SamplingParams(max_new_tokens=6), seed=k)
            trainer = backend.compute_log_probs(engine_batch(gens))
            sampled = torch.tensor([lp for g in gens for lp in g.log_probs])
            out.append(dict(bytes=stats["bytes"], diff=float((trainer - sampled).abs().max()), n=len(sampled)))
        fresh = HFEngine(ckpt, lora_scaling=SCALING)
        fresh.update_weights(dict(backend.stream_lora_adapters()))
        live, clean = engine.model.state_dict(), fresh.model.state_dict()
        same = all(torch.equal(live[n], clean[n]) for n in live)
        merged_moved = not torch.equal(
            live["model.layers.0.self_attn.q_proj.weight"], engine.lora.base["model.layers.0.self_attn.q_proj"]
        )
    finally:
        publisher.close()
    return dict(syncs=out, adapter_bytes=adapter_bytes, model_bytes=model_bytes, same=same, moved=merged_moved)


def test_hf_engine_lora_sync(run_world, tiny_qwen2):
    res = run_world(worker, 1, tiny_qwen2)[0]
    diffs = ", ".join(f"{s['diff']:.1e}" for s in res["syncs"])
    print(f"\nhf engine vs trainer log-probs, max |diff| per sync: {diffs}")
    for s in res["syncs"]:
        assert s["bytes"] == res["adapter_bytes"], s  # adapters only, every one of them (all changed)
        assert s["n"] > 4
        assert s["diff"] < 1e-4, s  # fp32 rounding of (W + s B A) x vs W x + s B (A x)
    assert res["adapter_bytes"] < 0.2 * res["model_bytes"]
    assert res["same"] and res["moved"]


def test_hf_engine_merge_never_accumulates(tiny_qwen2):
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    def adapters(seed):
        g = torch.Generator().manual_seed(seed)
        own = HFEngine(tiny_qwen2).model.state_dict()
        out = {}
        for name, w in own.items():
            if name.endswith(("q_proj.weight", "down_proj.weight")):
                m = name[: -len(".weight")]
                out[f"{m}.lora_A.weight"] = torch.randn(4, w.shape[1], generator=g)
                out[f"{m}.lora_B.weight"] = torch.randn(w.shape[0], 4, generator=g)
        return out

    x, y = adapters(1), adapters(2)
    engine, fresh, base = (
        HFEngine(tiny_qwen2, lora_scaling=SCALING),
        HFEngine(tiny_qwen2, lora_scaling=SCALING),
        HFEngine(tiny_qwen2),
    )
    for _ in range(20):
        for a in (x, y):  # A alone, then B alone: a bucket may split them
            engine.update_weights({k: v for k, v in a.items() if "lora_A" in k})
            engine.update_weights({k: v for k, v in a.items() if "lora_B" in k})
    engine.update_weights(x)
    fresh.update_weights(x)
    live, clean, orig = engine.model.state_dict(), fresh.model.state_dict(), base.model.state_dict()
    for name in live:
        assert torch.equal(live[name], clean[name]), name
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(
        live[f"{q}.weight"], orig[f"{q}.weight"] + SCALING * (x[f"{q}.lora_B.weight"] @ x[f"{q}.lora_A.weight"])
    )
    assert torch.equal(live["model.layers.0.self_attn.k_proj.weight"], orig["model.layers.0.self_attn.k_proj.weight"])
