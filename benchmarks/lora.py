"""LoRA vs full-model training on the FSDP backend: what shrinks, and what it costs per step.

Two parts, each LoRA (``--lora-rank 8 --lora-alpha 16 --target-modules all-linear``) against the
full model measured in the same run:

- ``tiny`` (the embedded Qwen2's shape with a 128-token vocabulary, measured): parameters trained, AdamW state bytes (summed over the
  optimizer's tensors after a step), checkpoint bytes (a real ``save_checkpoint``, files summed),
  step time (median of ``--steps`` train steps) and sync time (export + shared-memory publish +
  the hf engine's load: what a rollout's weight sync costs; the bytes that travel too).
- ``smollm2-shape`` (measured, ``--smollm2-shape``): the same on a random model of SmolLM2-135M's
  shape (Llama, 30 layers, hidden 576, 9 / 3 heads, vocabulary 49,152, tied), 3 steps.
- ``qwen2-0.5b`` (a random Qwen2-0.5B-shaped model built on the meta device from its config, no
  download, no memory): parameters trained, AdamW state bytes (2 fp32 moments per trained
  parameter) and checkpoint bytes (fp32 trained parameters + their moments; the frozen base is not
  in a LoRA checkpoint), by counting. Steps of the full model would need ~8 GiB here.

    python -m benchmarks.lora [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear"]
QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
    tie_word_embeddings=True,
)


def measure_tiny(rank, world, ckpt, lora: bool, steps: int):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.rollout.engines.hf_engine import HFEngine
    from rl_plugin.weight_sync import SyncRequest, WeightPublisher, WeightReceiver, load_sync, node_id
    from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *(LORA if lora else []), "--micro-batch-size", "9")))
    engine = HFEngine(ckpt, lora_scaling=2.0 if lora else None)
    publisher, receiver = WeightPublisher("shared_memory"), WeightReceiver()
    request = SyncRequest(buffer_bytes=512 * 2**20, transport="shared_memory", engine_nodes=(node_id(),))
    step_s, sync_s, sync_bytes = [], [], []
    try:
        for k in range(steps):
            t0 = time.perf_counter()
            backend.train_step(step_batch(make_step(k, with_ref=False)), num_groups=3)
            step_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if lora:
                handle = publisher.publish_stream(backend.lora_adapter_specs(), backend.stream_lora_adapters(), request)
            else:
                handle = publisher.publish_stream(backend.hf_weight_specs(), backend.stream_hf_weights(), request)
            stats = load_sync(engine, receiver, handle)
            sync_s.append(time.perf_counter() - t0)
            sync_bytes.append(stats["bytes"])
    finally:
        publisher.close()
    opt_bytes = sum(
        t.numel() * t.element_size()
        for s in backend.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    with tempfile.TemporaryDirectory() as d:
        files = backend.save_checkpoint(d, step=steps)
        ckpt_bytes = sum((Path(d) / f).stat().st_size for f in files)
    return dict(
        trained=sum(p.numel() for p in backend.params),
        opt_bytes=opt_bytes,
        ckpt_bytes=ckpt_bytes,
        step_s=statistics.median(step_s[1:] or step_s),
        sync_s=statistics.median(sync_s[1:] or sync_s),
        sync_bytes=sync_bytes[-1],
    )


def count_qwen2_05b(lora: bool):
    """Parameters trained, AdamW bytes and checkpoint bytes of the 0.5B shape, on the meta device."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rl_plugin.lora.targets import ALL_LINEAR

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B))
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_LINEAR)))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return dict(trained=trained, total=total, opt_bytes=2 * 4 * trained, ckpt_bytes=3 * 4 * trained)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smollm2-shape", action="store_true", help="also measure a random SmolLM2-135M-shaped model")
    args = ap.parse_args(argv)
    from rl_plugin.loop.embedded_setup import MODEL
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint
    from tests.support.harness import run_world

    shape = {k: v for k, v in MODEL.items() if k != "family"} | {"vocab_size": 128}  # the test batches' ids < 128
    ckpt = str(make_tiny_hf_checkpoint(Path(tempfile.mkdtemp(prefix="lora_bench_")) / "m", "qwen2", **shape))
    tiny = {name: run_world(measure_tiny, 1, ckpt, name == "lora", args.steps)[0] for name in ("full", "lora")}
    big = {name: count_qwen2_05b(name == "lora") for name in ("full", "lora")}
    mid = None
    if args.smollm2_shape:
        smol = str(make_tiny_hf_checkpoint(Path(tempfile.mkdtemp(prefix="lora_bench_")) / "s", "llama", **SMOLLM2))
        mid = {name: run_world(measure_tiny, 1, smol, name == "lora", 3)[0] for name in ("full", "lora")}
    print("\n| model | quantity | full | LoRA r=8 all-linear | LoRA / full |")
    print("| --- | --- | --- | --- | --- |")
    rows = [
        ("tiny (embedded Qwen2)", "parameters trained", tiny, "trained", str),
        ("tiny (embedded Qwen2)", "AdamW state", tiny, "opt_bytes", mib),
        ("tiny (embedded Qwen2)", "checkpoint (step dir)", tiny, "ckpt_bytes", mib),
        ("tiny (embedded Qwen2)", "bytes per weight sync", tiny, "sync_bytes", mib),
        ("tiny (embedded Qwen2)", "train step (median)", tiny, "step_s", lambda s: f"{1e3 * s:.1f} ms"),
        ("tiny (embedded Qwen2)", "weight sync (export+publish+load)", tiny, "sync_s", lambda s: f"{1e3 * s:.1f} ms"),
        ("Qwen2-0.5B shape (meta)", "parameters trained", big, "trained", lambda n: f"{n / 1e6:.2f} M"),
        ("Qwen2-0.5B shape (meta)", "AdamW state (fp32 m, v)", big, "opt_bytes", mib),
        ("Qwen2-0.5B shape (meta)", "checkpoint (trained + AdamW, fp32)", big, "ckpt_bytes", mib),
    ]
    if mid is not None:
        name = "SmolLM2-135M shape (random)"
        rows[6:6] = [(name, w, mid, k, f) for _, w, _, k, f in rows[:6]]
    for model, what, table, key, fmt in rows:
        full, lora = table["full"][key], table["lora"][key]
        print(f"| {model} | {what} | {fmt(full)} | {fmt(lora)} | {lora / full:.3g}x |")
    print(f"\nQwen2-0.5B shape: {big['full']['total'] / 1e6:.1f} M parameters in all")


if __name__ == "__main__":
    main()
