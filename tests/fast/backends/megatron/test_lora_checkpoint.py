"""The Megatron backend's adapter-only checkpoint state (``rl_plugin.backends.megatron.lora_checkpoint``)
on one rank (tiny Qwen2, ``--lora-rank 4 --target-modules all-linear``; the rank:
``tests.support.megatron_lora_state``): the sharded state holds exactly the adapters, keyed by their
canonical PEFT names at their full shapes, over the parameters themselves, and no base weight; a
load writes the given tensors into the parameters. (Resharded checkpoints across TP / DP / PP:
``test_lora.py``.)"""

from __future__ import annotations


def test_the_sharded_state_is_the_adapters_by_canonical_name(lora_adapter_state):
    out = lora_adapter_state
    names = out["names"]
    assert names == out["spec_names"] and names, names  # the export's names, in its order
    assert all(".lora_A." in n or ".lora_B." in n for n in names), names  # no base weight
    # all-linear on 2 layers: q, k, v, o, gate, up, down, each an A and a B
    assert len(names) == 2 * 7 * 2 and all(n.startswith("model.layers.") for n in names), names[:2]
    projections = {n.split(".")[4] for n in names}  # model.layers.L.<self_attn|mlp>.<proj>.lora_<A|B>.weight
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert out["keys_match"] and out["shapes_match"] and out["data_is_param"]


def test_a_load_writes_the_tensors_into_the_parameters(lora_adapter_state):
    assert lora_adapter_state["loaded"]  # read back through the export stream, every adapter equal
