"""The initial adapters (``rl_plugin.lora.init``): A seeded by name, PEFT's bound; B zero."""

import math

import torch

from rl_plugin.lora.init import initial_lora_a, initial_lora_b


def test_initial_a_depends_only_on_seed_name_and_shape():
    a = initial_lora_a("x.lora_A.weight", 4, 64, seed=7)
    assert torch.equal(a, initial_lora_a("x.lora_A.weight", 4, 64, seed=7))
    assert not torch.equal(a, initial_lora_a("y.lora_A.weight", 4, 64, seed=7))
    assert not torch.equal(a, initial_lora_a("x.lora_A.weight", 4, 64, seed=8))
    bound = 1 / math.sqrt(64)  # PEFT's kaiming_uniform_(a=sqrt(5)) bound
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert torch.count_nonzero(initial_lora_b(4, 32)) == 0 and initial_lora_b(4, 32).shape == (32, 4)
