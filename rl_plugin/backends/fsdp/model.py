"""The Hugging Face model of the FSDP backend: load, ``--fp32-lm-head``, FSDP2 sharding.

Master weights are fp32 (the checkpoint is loaded in fp32 whatever its stored dtype); with
``--bf16`` FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` all-gathers bf16
compute copies and reduce-scatters gradients in fp32 into the fp32 sharded master gradients, the
same split as Megatron's bf16 training with fp32 main params.

Gradient reduction is a plain SUM over data parallelism: every FSDP unit gets
``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)``, so FSDP2's
default averaging (divide by dp_size) never happens. The loss core's ``out.objective`` summed over
all ranks and micro-batches is J, so backpropagating it unscaled applies exactly dJ/dtheta.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rl_plugin.loss.logprobs import fp32_output_projection


def load_hf_model(path: str, *, attn_implementation: str = "sdpa") -> nn.Module:
    """``AutoModelForCausalLM`` from an HF directory, fp32 master weights, training mode, no
    embedding ``padding_idx`` (see below)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    model.config.use_cache = False  # training forward: no KV cache (a cache also disables packing detection)
    embed = model.get_input_embeddings()
    if isinstance(embed, nn.Embedding):
        # HF builds nn.Embedding(padding_idx=pad_token_id), which zeroes that row's gradient. In RL
        # the pad id is often a real, sampled token (Qwen's <|endoftext|>), and megatron-core's
        # embedding has no padding_idx: clear it so both backends train that row. Padding positions
        # (bshd) never reach a loss, so they still add exactly 0 to it.
        embed.padding_idx = None
    model.train()
    return model


class FP32LMHead(nn.Module):
    """``--fp32-lm-head``: the output projection with fp32 accumulation and fp32 logits.

    It holds the ORIGINAL ``weight`` Parameter object of the replaced ``nn.Linear`` (not a copy),
    so a tied input embedding stays tied and the gradient (computed in fp32 by
    ``fp32_output_projection``, cast to the weight's compute dtype) reaches the weight FSDP
    reduces into the fp32 master gradient.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight  # same Parameter: keeps ties and the state-dict name
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return fp32_output_projection(hidden, self.weight, self.bias)


def install_fp32_lm_head(model: nn.Module) -> nn.Module:
    """Replace ``model.lm_head`` (before sharding) by ``FP32LMHead`` around the same Parameter."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"--fp32-lm-head: the model's output embedding is {type(head).__name__}, expected nn.Linear")
    tied = head.weight is model.get_input_embeddings().weight
    model.set_output_embeddings(FP32LMHead(head))
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("--fp32-lm-head: replacing the head broke the tie with the input embedding")
    return model


def decoder_layers(model: nn.Module) -> list:
    """The model's transformer blocks: modules whose class is in HF's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={sorted(names)})")
    return layers


def shard_model(model: nn.Module, mesh, *, bf16: bool, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp: Optional[MixedPrecisionPolicy] = None
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # SUM, not mean, over DP (see the module docstring): J's gradient is the sum of every
            # rank's share; averaging would divide it by dp_size.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
