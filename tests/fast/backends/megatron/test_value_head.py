"""The Megatron value model's construction, head and HF export (``value_head.py``, issue 47).

One spawn per case (TP1 on an untied model, TP2 on a tied one): a fresh head gives exactly zero
values; with a seeded head the backend's forward-only values equal those of its own export loaded
by transformers' ``AutoModelForTokenClassification`` (num_labels=1, no head bias); the export's
names are the causal LM's with ``lm_head.weight`` replaced by ``score.weight`` ``[1, H]`` (a tied
model's embedding stays one tensor), the weight sync's stream and specs give the same; a value
model built from the export (``--critic-load`` of an HF directory) loads its head and gives the
same values bitwise; a head of another shape, LoRA and loading an actor's checkpoint are refused by name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.support.tolerance import FP32_MODEL


def export_worker(rank, world, tp, hf_dir, out_dir):
    from safetensors.torch import load_file, save_file

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.setup import MegatronSetupError
    from rl_plugin.checkpoint.compat import CheckpointMismatchError
    from tests.support.megatron_common import make_args, synthetic_batch
    from tests.support.megatron_value import seeded_head, value_backend

    flags = ("--tensor-model-parallel-size", str(tp))
    actor_ckpt = f"{out_dir}_actor/iter_0000001"
    MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, *flags, world_size=world)).save_checkpoint(
        actor_ckpt, step=1
    )
    backend = value_backend(hf_dir, *flags, world_size=world)
    try:
        backend.load_checkpoint(actor_ckpt)
        actor_error = None
    except CheckpointMismatchError as e:
        actor_error = str(e)
    batch, _ = synthetic_batch(seed=3)
    fresh = backend.compute_values(batch)
    seeded_head(backend, seed=0)
    values = backend.compute_values(batch)
    state = backend.export_hf_state_dict()
    specs = backend.hf_weight_specs()
    streamed = dict(backend.stream_hf_weights())
    backend.save_hf(out_dir)
    again = value_backend(out_dir, *flags, world_size=world).compute_values(batch)
    bad = f"{out_dir}_bad"
    if rank == 0:
        shutil.copytree(out_dir, bad)
        weights = load_file(f"{bad}/model.safetensors")
        weights["score.weight"] = torch.zeros(2, weights["score.weight"].shape[1])
        save_file(weights, f"{bad}/model.safetensors")
    torch.distributed.barrier()
    try:
        value_backend(bad, *flags, world_size=world)
        bad_error = None
    except ValueError as e:
        bad_error = str(e)
    try:
        value_backend(hf_dir, *flags, "--lora-rank", "4", world_size=world)
        lora_error = None
    except MegatronSetupError as e:
        lora_error = str(e)
    if rank:
        return None
    return dict(
        fresh=fresh,
        values=values,
        again=again,
        state={k: tuple(v.shape) for k, v in state.items()},
        specs={k: tuple(v.shape) for k, v in specs.items()},
        stream_equal=sorted(streamed) == sorted(state) and all(torch.equal(streamed[k], state[k]) for k in state),
        bad_error=bad_error,
        lora_error=lora_error,
        actor_error=actor_error,
    )


@pytest.fixture(scope="module", params=[(1, False), (2, True)], ids=["tp1-untied", "tp2-tied"])
def case(request, run_world, tiny_checkpoint, tmp_path_factory):
    tp, tied = request.param
    hf_dir = str(tiny_checkpoint(tie_word_embeddings=tied))
    out_dir = str(tmp_path_factory.mktemp("value_export") / "hf")
    return hf_dir, out_dir, run_world(export_worker, tp, tp, hf_dir, out_dir)[0]


def test_fresh_head_is_zero(case):
    _, _, got = case
    assert got["fresh"].shape == got["values"].shape and got["fresh"].numel() > 0
    assert torch.equal(got["fresh"], torch.zeros_like(got["fresh"]))


def test_export_loads_into_hf_token_classification(case):
    from safetensors import safe_open

    from tests.support.megatron_common import synthetic_batch
    from tests.support.megatron_value import hf_values

    hf_dir, out_dir, got = case
    with safe_open(str(Path(hf_dir) / "model.safetensors"), framework="pt") as f:
        causal = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    hidden = causal["model.embed_tokens.weight"][1]
    expected = {k: v for k, v in causal.items() if k != "lm_head.weight"} | {"score.weight": (1, hidden)}
    assert got["state"] == expected
    assert got["specs"] == expected and got["stream_equal"]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(out_dir)
    assert config.architectures == ["Qwen2ForTokenClassification"] and config.num_labels == 1
    assert config.token_classification_bias is False
    batch, _ = synthetic_batch(seed=3)
    ref = hf_values(out_dir, batch)
    values = got["values"][:, 0] if got["values"].dim() == 2 else got["values"]
    assert float(ref.abs().max()) > 1.0  # the seeded head: values far from zero
    err = float((values - ref).abs().max())
    assert err <= FP32_MODEL * float(ref.abs().max()), err


def test_value_model_from_its_export_loads_the_head(case):
    _, _, got = case
    assert torch.equal(got["again"], got["values"])


def test_bad_head_lora_and_an_actor_checkpoint_are_refused(case):
    _, _, got = case
    # the actor's checkpoint: the vocabulary head (untied) or no head at all (tied) where the critic's is [1, H]
    assert got["actor_error"] is not None and "output_layer.weight" in got["actor_error"], got["actor_error"]
    assert got["bad_error"] is not None and "score.weight has shape (2, 32)" in got["bad_error"]
    assert "(1, 32)" in got["bad_error"] and "num_labels=1" in got["bad_error"]
    assert got["lora_error"] is not None and "--lora-rank" in got["lora_error"] and "LoRA off" in got["lora_error"]
