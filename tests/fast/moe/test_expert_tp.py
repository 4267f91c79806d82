"""Tensor parallelism with an MoE model: megatron-core 0.16.1 refuses to train an MoE layer under
TP > 1 without sequence parallelism (``moe_layer.py`` l. 379-383, at the first training forward),
and sequence parallelism needs transformer-engine here, so the Megatron backend refuses the layout
before any group or model is built, naming the flag and the fix (expert parallelism). A dense
model at TP 2 is not affected; expert parallelism of a dense model is refused."""

from __future__ import annotations

import pytest


def test_moe_under_tensor_parallelism_is_refused_up_front(tmp_path):
    from rl_plugin.backends.megatron.setup import MegatronSetupError, check_supported
    from rl_plugin.configs import ModelConfig, MoEConfig
    from rl_plugin.models.tiny import tiny_config
    from rl_plugin.models.tiny_moe import MOE_SIZES

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    tiny_config("qwen3_moe", **MOE_SIZES).save_pretrained(moe)
    tiny_config("qwen3").save_pretrained(dense)
    with pytest.raises(MegatronSetupError, match="--tensor-model-parallel-size 2 with the mixture-of-experts"):
        check_supported(ModelConfig(hf_checkpoint=str(moe), tensor_model_parallel_size=2))
    check_supported(ModelConfig(hf_checkpoint=str(moe), tensor_model_parallel_size=1))
    check_supported(ModelConfig(hf_checkpoint=str(dense), tensor_model_parallel_size=2))
    with pytest.raises(MegatronSetupError, match="--expert-model-parallel-size 2 with .*: the model has no experts"):
        check_supported(ModelConfig(hf_checkpoint=str(dense), moe=MoEConfig(expert_model_parallel_size=2)))
