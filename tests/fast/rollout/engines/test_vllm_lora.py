"""LoRA into the vLLM engine (CPU build): adapters loaded as a LoRARequest, replaced each sync.

The FSDP backend trains LoRA adapters (rank 4, alpha 8) for two steps; after each, the adapters
(the trainer's stream, split over buckets) go into a ``VLLMEngine`` built with ``--lora-rank``:
(1) what the engine reads back from its LoRA layers equals the adapters sent, bitwise (the
``--check-lora-weight-equal`` read-back), (2) each sync registers a new adapter id and removes the
last, and (3) the engine's sampled log-probs equal the trainer's (the backend started from the
same adapters through ``--lora-adapter-path``) within ``test_engines``' bounds. The model is a tied
Llama: vLLM wraps its embedding and head as LoRA layers too, which the read-back must skip (the
first SmolLM2 run failed there).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.fast.rollout.engines.test_engines import MAX_BOUND, MEAN_BOUND, _spawned
from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--micro-batch-size", "3"]
PROMPTS = [[1, 5, 9, 30], [1, 5, 9, 30], [7, 7, 100]]


def train(rank, world, ckpt):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *LORA, "--lr", "0.05")))
    out = []
    for k in range(2):
        backend.train_step(step_batch(make_step(k, with_ref=False)), num_groups=3)
        out.append(dict(backend.stream_lora_adapters()))
    return out


def engine_side(ckpt, syncs):
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(ckpt, device="cpu", max_model_len=64, lora_rank=4, lora_alpha=8.0)
    out = []
    for k, adapters in enumerate(syncs):
        names = list(adapters)
        eng.update_weights({n: adapters[n] for n in names[::2]})  # two buckets
        eng.update_weights({n: adapters[n] for n in names[1::2]})
        gens = eng.generate(PROMPTS, SamplingParams(1.0, 1.0, 6), seed=k)
        out.append(dict(gens=gens, read=eng.weights(), ids=sorted(eng.llm.llm_engine.list_loras())))
    eng.lora.close()
    return out


def trainer_log_probs(rank, world, ckpt, adapter_dirs, gens_per_sync):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from tests.fast.rollout.engines.test_lora_merge import engine_batch

    out = []
    for d, gens in zip(adapter_dirs, gens_per_sync):
        backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *LORA, "--lora-adapter-path", d)))
        out.append(backend.compute_log_probs(engine_batch(gens)))
    return out


def test_vllm_serves_the_synced_adapters(run_world, tmp_path):
    from rl_plugin.lora.peft_dir import write_peft_dir
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    ckpt = str(
        make_tiny_hf_checkpoint(
            tmp_path / "m",
            "llama",  # tied, as SmolLM2: vLLM wraps a Llama's embedding and head for LoRA too (not ours to read)
            vocab_size=128,
            hidden_size=64,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
            tie_word_embeddings=True,
        )
    )
    syncs = run_world(train, 1, ckpt)[0]
    served = _spawned(engine_side, ckpt, syncs)
    dirs = []
    for k, adapters in enumerate(syncs):
        d = tmp_path / f"adapters{k}"
        write_peft_dir(str(d), adapters, rank=4, alpha=8.0, dropout=0.0, targets=["q_proj"])
        dirs.append(str(d))
    trainer = run_world(trainer_log_probs, 1, ckpt, dirs, [s["gens"] for s in served])[0]
    for k, (adapters, s) in enumerate(zip(syncs, served)):
        assert s["ids"] == [k + 1]  # a new adapter per sync, the last one removed
        assert s["read"].keys() == adapters.keys()
        for name, t in adapters.items():
            assert torch.equal(s["read"][name], t), name
        sampled = torch.tensor([lp for g in s["gens"] for lp in g.log_probs])
        err = (trainer[k] - sampled).abs()
        print(
            f"\nvLLM LoRA sync {k + 1}: |engine - trainer| log-prob mean {float(err.mean()):.1e} max {float(err.max()):.1e}"
        )
        assert float(err.mean()) < MEAN_BOUND and float(err.max()) < MAX_BOUND
    assert not torch.equal(
        syncs[0]["model.layers.0.self_attn.q_proj.lora_B.weight"],
        syncs[1]["model.layers.0.self_attn.q_proj.lora_B.weight"],
    )
