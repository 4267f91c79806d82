"""Canonical LoRA parameter names (``rl_plugin.lora.names``) and their PEFT file form."""

from rl_plugin.lora.names import canonical_name, hf_module_path, lora_a_name, peft_file_name


def test_names_round_trip_through_a_peft_file():
    name = lora_a_name(hf_module_path(3, "up_proj"))
    assert name == "model.layers.3.mlp.up_proj.lora_A.weight"
    assert peft_file_name(name) == "base_model.model.model.layers.3.mlp.up_proj.lora_A.weight"
    assert canonical_name("base_model.model.model.layers.3.mlp.up_proj.lora_A.default.weight") == name
