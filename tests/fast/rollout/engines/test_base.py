"""The engine interface's helpers (``rl_plugin.rollout.engines.base``): the stop ids of a
checkpoint (generation config first, then the model config, an int or a list; none is refused
naming the checkpoint), the missing-package refusal naming the flag and the install step, the
factory refusing an unknown engine, and ``SamplingParams``' defaults."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rl_plugin.configs import EngineConfig
from rl_plugin.registries import INSTALL_HINTS
from rl_plugin.registry_base import RegistryError
from rl_plugin.rollout.engines.base import Generation, SamplingParams, eos_token_ids, make_engine, require_package


def _checkpoint(path, eos_in_config, generation=None):
    """A checkpoint directory with a Llama ``config.json`` (``eos_token_id`` as given; the key left
    out for None) and, when ``generation`` is a dict, a ``generation_config.json``."""
    path.mkdir()
    cfg = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "num_attention_heads": 2}
    cfg["eos_token_id"] = eos_in_config
    (path / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_the_generation_config_names_the_stop_ids_first(tmp_path):
    ck = _checkpoint(tmp_path / "a", 2, {"eos_token_id": [7, 2]})
    assert eos_token_ids(str(ck)) == [7, 2]
    ck = _checkpoint(tmp_path / "b", 2, {"eos_token_id": 9})
    assert eos_token_ids(str(ck)) == [9]


def test_the_model_config_stands_in_without_a_generation_config(tmp_path):
    assert eos_token_ids(str(_checkpoint(tmp_path / "a", 3))) == [3]
    assert eos_token_ids(str(_checkpoint(tmp_path / "b", [3, 5], {"do_sample": True}))) == [3, 5]


def test_a_checkpoint_without_any_eos_is_refused(tmp_path):
    ck = _checkpoint(tmp_path / "a", None)
    with pytest.raises(ValueError) as info:
        eos_token_ids(str(ck))
    assert str(info.value) == (
        f"{ck}: neither generation_config.json nor config.json names an eos_token_id; set one so responses can end"
    )


def test_a_missing_package_is_named_with_its_install_step(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(RuntimeError) as info:
        require_package("sglang")
    assert str(info.value) == (
        f"--rollout-engine sglang: the Python package 'sglang' is not installed; {INSTALL_HINTS['sglang']}, "
        "or use --rollout-engine hf"
    )
    require_package("torch")  # installed: no error


def test_an_unknown_engine_lists_the_registered_ones(tmp_path):
    config = dataclasses.replace(EngineConfig(), engine="trt")
    with pytest.raises(RegistryError, match=r"^--rollout-engine 'trt': unknown rollout engine; choose from .*hf.*vllm"):
        make_engine(config, str(tmp_path))


def test_sampling_params_and_generation_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.max_new_tokens, p.top_k, p.stop_token_ids) == (1.0, 1.0, 16, -1, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    g = Generation(prompt_ids=[1, 3], response_ids=[5, 2], log_probs=[-0.1, -0.2], finished=True)
    assert g.routed_experts is None and g.weight_versions is None
