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
    setup.check_supported(model_config())


def test_pipeline_parallel_is_rejected():
    """The flag rule refuses it at parse time (test_arguments); the backend refuses a config built without the CLI."""
    args = ModelConfig(pipeline_model_parallel_size=2)
    with pytest.raises(MegatronSetupError, match=r"--pipeline-model-parallel-size > 1 is not supported.*Fix"):
        setup.check_supported(args)


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
