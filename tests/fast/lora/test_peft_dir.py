"""A PEFT adapter directory (``rl_plugin.lora.peft_dir``): written under PEFT's keys with the config
fields PEFT reads, read back by canonical name bitwise; the files a directory lacks. (``peft``
itself loading such a directory: ``backends/megatron/test_lora.py``.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from rl_plugin.lora.peft_dir import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    missing_files,
    read_peft_dir,
    write_peft_dir,
    write_run_adapters,
)

A = "model.layers.0.self_attn.q_proj.lora_A.weight"
B = "model.layers.0.self_attn.q_proj.lora_B.weight"


def _adapters():
    g = torch.Generator().manual_seed(0)
    return {A: torch.randn(4, 16, generator=g), B: torch.randn(16, 4, generator=g).t().contiguous().t()}


def test_write_then_read_is_bitwise_under_peft_keys(tmp_path):
    adapters = _adapters()
    out = write_peft_dir(str(tmp_path / "ad"), adapters, rank=4, alpha=8, dropout=0.05, targets=["v_proj", "q_proj"])
    assert missing_files(str(out)) == ()
    assert sorted(load_file(str(out / WEIGHTS_FILE))) == [f"base_model.model.{A}", f"base_model.model.{B}"]
    config, back = read_peft_dir(str(out))
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == ("LORA", 4, 8.0, 0.05)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["bias"] == "none"
    assert config["base_model_name_or_path"] is None and config["task_type"] == "CAUSAL_LM"
    assert json.loads((out / CONFIG_FILE).read_text()) == config
    assert set(back) == {A, B} and all(torch.equal(back[k], adapters[k]) for k in adapters)


def test_dtype_and_the_runs_targets(tmp_path):
    lora = SimpleNamespace(
        lora_rank=2, lora_alpha=4.0, lora_dropout=0.0, target_modules=["all-linear"], exclude_modules=["o_proj"]
    )
    adapters = {A: torch.ones(2, 3, dtype=torch.float64)}
    out = write_run_adapters(str(tmp_path), adapters, lora, "my/base")
    config, back = read_peft_dir(str(out))
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    assert config["base_model_name_or_path"] == "my/base" and back[A].dtype == torch.float32  # fp32 by default
    bf = write_peft_dir(
        str(tmp_path / "bf"), adapters, rank=2, alpha=4, dropout=0, targets=["q_proj"], dtype=torch.bfloat16
    )
    assert read_peft_dir(str(bf))[1][A].dtype == torch.bfloat16


def test_missing_files(tmp_path):
    assert missing_files(str(tmp_path)) == (CONFIG_FILE, WEIGHTS_FILE)
    (tmp_path / CONFIG_FILE).write_text("{}")
    assert missing_files(str(tmp_path)) == (WEIGHTS_FILE,)
