"""Start-up rules of the Megatron backend: each raises naming the flag and the fix."""

from __future__ import annotations

import pytest

from rl_plugin.backends.megatron import setup
from rl_plugin.backends.megatron.bridge import transformer_engine_available
from rl_plugin.backends.megatron.setup import MegatronSetupError
from rl_plugin.configs import ModelConfig
from tests.support.megatron_common import make_args


def model_config(*flags, world_size=1):
    return ModelConfig.from_args(make_args(*flags, world_size=world_size))


@pytest.mark.skipif(transformer_engine_available(), reason="transformer-engine is installed: CP is allowed")
def test_context_parallel_without_transformer_engine_fails_loud():
    args = model_config("--context-parallel-size", "2", world_size=2)
    with pytest.raises(
        MegatronSetupError, match=r"--context-parallel-size 2.*transformer-engine.*--context-parallel-size 1"
    ):
        setup.check_supported(args)


@pytest.mark.skipif(transformer_engine_available(), reason="transformer-engine is installed: SP is allowed")
def test_sequence_parallel_without_transformer_engine_fails_loud():
    args = model_config("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2)
    with pytest.raises(MegatronSetupError, match=r"--sequence-parallel.*transformer-engine.*drop --sequence-parallel"):
        setup.check_supported(args)


def test_context_parallel_one_is_fine():
    """The boundary is CP > 1: the default layout (CP 1) passes, and the same flags with CP 2 are
    refused on this installation (no transformer-engine), naming the flag."""
    cfg = model_config()
    assert cfg.context_parallel_size == 1 and not cfg.sequence_parallel
    assert setup.check_supported(cfg) is None
    if not transformer_engine_available():
        with pytest.raises(MegatronSetupError, match=r"--context-parallel-size 2"):
            setup.check_supported(model_config("--context-parallel-size", "2", world_size=2))


def test_pipeline_parallel_is_supported():
    """PP > 1 runs (tests/fast/parity/test_pipeline.py); the world must be a multiple of TP x CP x PP."""
    setup.check_supported(ModelConfig(pipeline_model_parallel_size=2))
    setup.check_world(4, 1, 1, 2)
    with pytest.raises(MegatronSetupError, match=r"world size 3 .*--pipeline-model-parallel-size 2.*multiple of 2"):
        setup.check_world(3, 1, 1, 2)


def test_fp16_is_rejected_before_building():
    with pytest.raises(MegatronSetupError, match=r"--fp16 is not supported.*--bf16"):
        setup.build_model(ModelConfig(fp16=True), "/nonexistent")


def test_world_not_divisible_by_model_parallel():
    with pytest.raises(MegatronSetupError, match=r"world size 3 is not a multiple of --tensor-model-parallel-size 2"):
        setup.check_world(3, 2, 1)
    setup.check_world(4, 2, 1)


def test_vocab_not_divisible_by_tp():
    with pytest.raises(MegatronSetupError, match=r"--tensor-model-parallel-size 2: the vocabulary \(127\)"):
        setup.check_vocab(127, 2)
    setup.check_vocab(128, 2)


def test_cpu_tuning_stays_off_gpus(monkeypatch):
    """The fusions go off only without CUDA (cpu_shim); the CPU overrides are exactly the ones
    every CPU run used before (bitwise the same runs), a GPU with transformer-engine keeps
    megatron-core's defaults (without it: ``compat/test_without_te.py``)."""
    cfg = model_config()
    monkeypatch.setattr(setup, "transformer_engine_available", lambda: True)
    cpu = setup.config_overrides(cfg, cuda=False)
    assert cpu == dict(
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        moe_shared_expert_overlap=False,  # a CUDA side stream; read by MoE models with a shared expert only
        perform_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=True,
        sequence_parallel=False,
        use_cpu_initialization=True,
        context_parallel_size=1,
    )
    gpu = setup.config_overrides(cfg, cuda=True)
    assert gpu == dict(
        perform_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=True,
        sequence_parallel=False,
        use_cpu_initialization=False,
        context_parallel_size=1,
    )


def test_packed_rope_patch_is_cpu_only():
    import importlib

    from megatron.core.models.common.embeddings import rope_utils

    from rl_plugin.backends.megatron.compat import cpu_shim, rope_thd

    modules = [importlib.import_module(name) for name in rope_thd.MODULES]

    before = rope_utils._apply_rotary_pos_emb_thd
    original = rope_thd._ORIGINAL.get("fn", before)
    try:
        for mod in modules:  # megatron-core's own function, as a fresh process has it
            mod._apply_rotary_pos_emb_thd = original
        assert cpu_shim.install_cpu_rope(cuda=True) is False
        assert rope_utils._apply_rotary_pos_emb_thd is original
        assert cpu_shim.install_cpu_rope(cuda=False) is True
        assert rope_utils._apply_rotary_pos_emb_thd is rope_thd.vectorized_thd_rope
    finally:
        for mod in modules:
            mod._apply_rotary_pos_emb_thd = before


def test_interleaved_micro_batch_count():
    """megatron-core 0.16.1's interleaved schedule needs M to be a multiple of P (groups of P
    micro-batches per virtual stage): the plan is padded with idle micro-batches to the next one."""
    from rl_plugin.backends.megatron.step import interleaved_count

    assert [interleaved_count(m, 2) for m in (1, 2, 3, 6)] == [2, 2, 4, 6]
    assert [interleaved_count(m, 4) for m in (1, 4, 5)] == [4, 4, 8]
