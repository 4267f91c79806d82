"""``rl_plugin.models.value_head``: the critic's Hugging Face form (token classification, one
label, no head bias), written and loaded back by transformers, and the families without one."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.models.value_head import (
    is_value_config,
    token_classification_class,
    value_config,
    write_value_hf_dir,
)


def test_value_config_is_one_label_token_classification(tiny_qwen2):
    from transformers import AutoConfig

    lm = AutoConfig.from_pretrained(tiny_qwen2)
    cfg = value_config(lm)
    assert cfg.architectures == ["Qwen2ForTokenClassification"] and cfg.num_labels == 1
    assert cfg.token_classification_bias is False and cfg.classifier_dropout == 0.0
    assert is_value_config(cfg) and not is_value_config(lm)
    assert lm.architectures == ["Qwen2ForCausalLM"]  # the causal LM's config is left as it was
    assert token_classification_class("llama") == "LlamaForTokenClassification"
    with pytest.raises(ValueError, match="no such class for model_type 'cohere'.*Fix: train the critic"):
        token_classification_class("cohere")


def test_written_directory_loads_with_the_same_weights(tiny_qwen2, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForTokenClassification

    sd = {k: v for k, v in load_file(f"{tiny_qwen2}/model.safetensors").items() if k.startswith("model.")}
    sd["score.weight"] = torch.arange(32, dtype=torch.float32).view(1, 32) / 100
    write_value_hf_dir(str(tmp_path / "critic"), sd, AutoConfig.from_pretrained(tiny_qwen2), source_dir=tiny_qwen2)
    model = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"), dtype=torch.float32)
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(sd)  # nothing newly initialised, nothing left over
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert (tmp_path / "critic" / "generation_config.json").is_file()
    ids = torch.tensor([[3, 5, 7, 9]])
    hidden = model.model(input_ids=ids).last_hidden_state
    assert torch.equal(model(input_ids=ids).logits, hidden @ sd["score.weight"].t())  # V = score . h


def test_a_state_without_the_head_or_with_an_lm_head_is_refused(tmp_path, tiny_qwen2):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_qwen2)
    with pytest.raises(ValueError, match=r"no score.weight of shape \[1, hidden\]"):
        write_value_hf_dir(str(tmp_path / "a"), {"model.norm.weight": torch.ones(32)}, config)
    with pytest.raises(ValueError, match=r"names outside model.\* and score.weight: \['lm_head.weight'\]"):
        write_value_hf_dir(
            str(tmp_path / "b"), {"score.weight": torch.ones(1, 32), "lm_head.weight": torch.ones(128, 32)}, config
        )
