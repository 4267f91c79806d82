"""LoRA checkpoints and exports of the FSDP backend (one gloo process, tiny Qwen2, fp32).

- The step directory holds the adapters and their AdamW state only (no base tensor in DCP's
  metadata, not even the tied head's alias of the frozen embedding) plus ``lora.json`` (rank, alpha, targets, the base's fingerprint); a fresh backend that
  loads it runs step 2 bit for bit as the uninterrupted one.
- A load onto another base (a tiny model of another seed) is refused, naming both bases; a
  full-model run refuses a LoRA checkpoint; a run with another ``--lora-alpha`` is refused naming
  both values (issue 44 item 4: it resumed silently, its adapters' update rescaled).
- ``--save-hf`` writes a PEFT adapter directory: ``peft.PeftModel.from_pretrained(base, dir)``
  gives the trainer's log-probs (within fp32 rounding), and ``--lora-adapter-path dir`` starts a
  new run's adapters from it bit for bit. ``--save-hf-merged`` writes the merged model, which
  ``AutoModelForCausalLM`` loads with the same log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support import checkpointing
from tests.support.fsdp_common import alone_log_probs, fsdp_flags, make_step, parse, step_batch, tiny_checkpoint
from tests.support.tolerance import FP32_MODEL, tensor_within

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "0.05", "--micro-batch-size", "3"]


def batch(seed):
    return step_batch(make_step(seed, with_ref=False))


def first_run(rank, world, ckpt, root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    flags = [*LORA, "--save-hf", f"{root}/peft", "--save-hf-merged", f"{root}/merged"]
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *flags)))
    backend.train_step(batch(1), num_groups=3)
    checkpointing.save(backend, f"{root}/save", 1)
    logp = backend.compute_log_probs(batch(5))
    adapters = dict(backend.stream_lora_adapters())
    report = backend.train_step(batch(2), num_groups=3)
    return dict(logp=logp, adapters=adapters, report=report, after=dict(backend.stream_lora_adapters()))


def resumed(rank, world, ckpt, root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *LORA)))
    checkpointing.load(backend, f"{root}/save")
    report = backend.train_step(batch(2), num_groups=3)
    return dict(report=report, after=dict(backend.stream_lora_adapters()))


def warm_started(rank, world, ckpt, root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *LORA, "--lora-adapter-path", f"{root}/peft")))
    return dict(backend.stream_lora_adapters())


def load_error(rank, world, ckpt, root, lora: bool, *extra):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *(LORA if lora else []), *extra)))
    try:
        checkpointing.load(backend, f"{root}/save")
    except ValueError as exc:
        return str(exc)
    return None


def all_runs(rank, world, ckpt, other, root):
    """Every run in one process (one spawn: the tests stay fast)."""
    return dict(
        first=first_run(rank, world, ckpt, root),
        again=resumed(rank, world, ckpt, root),
        warm=warm_started(rank, world, ckpt, root),
        wrong=load_error(rank, world, other, root, True),
        full=load_error(rank, world, ckpt, root, False),
        alpha=load_error(rank, world, ckpt, root, True, "--lora-alpha", "16"),  # saved with 8
    )


@pytest.fixture(scope="module")
def runs(run_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_lora_ckpt")
    # tied embeddings: torch's ignore_frozen_params kept the frozen head's alias (regression)
    ckpt = tiny_checkpoint(root, "qwen2", tie_word_embeddings=True)
    other = tiny_checkpoint(root / "other", "qwen2", seed=1, tie_word_embeddings=True)
    out = run_world(all_runs, 1, ckpt, other, str(root))[0]
    return dict(root=root, ckpt=ckpt, other=other, **out)


def test_checkpoint_is_adapter_only_and_resumes_bitwise(runs):
    import torch.distributed.checkpoint as dcp

    step_dir = Path(runs["root"]) / "save" / "iter_0000001"
    keys = list(dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]
    assert any(k.startswith("optim.state.") and ".lora_" in k for k in keys)
    meta = json.loads((step_dir / "lora.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": sorted(meta["lora"]["targets"])}
    assert len(meta["lora"]["targets"]) == 7 and "model.safetensors" in meta["base"]["weights"]
    first, again = runs["first"], runs["again"]
    assert again["report"] == first["report"]
    for name, t in first["after"].items():
        assert torch.equal(again["after"][name], t), name


def test_load_refuses_another_base_naming_both(runs):
    msg = runs["wrong"]
    assert msg is not None and "trained on the base model" in msg
    assert str(runs["ckpt"]) in msg and str(runs["other"]) in msg
    assert "without --lora-rank" in runs["full"] or "LoRA checkpoint" in runs["full"]


def test_load_refuses_another_lora_alpha_naming_both(runs):
    """Issue 44 item 4: saved with --lora-alpha 8, resumed with 16: refused (it resumed silently)."""
    msg = runs["alpha"]
    assert msg is not None, "a resume with another --lora-alpha was accepted"
    assert "--lora-alpha 8 in the checkpoint, 16 in this run" in msg, msg
    assert "Fix: resume with the checkpoint's --lora-rank 4 --lora-alpha 8" in msg, msg


def test_save_hf_is_a_peft_directory_with_the_trainers_log_probs(runs):
    from peft import PeftModel

    from rl_plugin.backends.fsdp.model import load_hf_model

    root, first = Path(runs["root"]), runs["first"]
    assert sorted(p.name for p in (root / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = load_hf_model(runs["ckpt"], attn_implementation="eager").eval()
    peft_model = PeftModel.from_pretrained(base, str(root / "peft")).eval()
    with torch.no_grad():
        logp = alone_log_probs(peft_model, batch(5)).float()
    assert tensor_within(first["logp"], logp, rtol=FP32_MODEL)
    # the adapters it loaded are the trainer's, bit for bit
    loaded = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(first["adapters"]) == 28


def test_save_hf_merged_loads_as_a_plain_model(runs):
    from transformers import AutoModelForCausalLM

    root, first = Path(runs["root"]), runs["first"]
    model = AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32).eval()
    assert not any(".lora_" in k or "base_layer" in k for k in model.state_dict())
    with torch.no_grad():
        logp = alone_log_probs(model, batch(5)).float()
    assert tensor_within(first["logp"], logp, rtol=FP32_MODEL)


def test_lora_adapter_path_warm_starts_bitwise(runs):
    first, warm = runs["first"], runs["warm"]
    assert warm.keys() == first["adapters"].keys()
    for name, t in first["adapters"].items():
        assert torch.equal(warm[name], t), name
