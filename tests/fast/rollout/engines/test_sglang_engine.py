"""The SGLang engine (``rl_plugin.rollout.engines.sglang_engine``) on a machine without it: fails loud."""

import pytest

from rl_plugin.configs import EngineConfig
from rl_plugin.rollout.engines.base import make_engine


def test_sglang_fails_loud_without_the_package_or_a_gpu(tmp_path):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    ck = make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", vocab_size=16, hidden_size=32, intermediate_size=64)
    with pytest.raises(
        RuntimeError,
        match="--rollout-engine sglang: the Python package 'sglang' is not installed|--rollout-engine sglang needs a GPU",
    ):
        make_engine(EngineConfig(engine="sglang"), str(ck))
