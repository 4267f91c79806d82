"""The Hugging Face model of the FSDP backend: load, ``--fp32-lm-head``, FSDP2 sharding.

Dropout is off, as in the Megatron backend (``setup.py``: hidden_dropout = attention_dropout =
0): every dropout probability of the checkpoint's config (``disable_dropout``) is set to 0 before
the model is built, and any ``nn.Dropout`` left with p > 0 is zeroed after. The train-mode forward
is then the eval-mode forward the old log-probs come from, so the PPO ratio is exactly 1 at step 0
(with the checkpoint's dropout, 0.1 moved a tiny model's log-probs by up to ~0.07 nats).

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

import contextlib
import logging
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from rl_plugin.loss import ForwardOptions, default_chunk_rows, fp32_output_projection, fused_log_probs_and_entropy
from rl_plugin.models.hf_head import fused_head_unsupported
from rl_plugin.models.value_head import is_value_config, value_config

logger = logging.getLogger(__name__)


def _is_dropout_field(name: str) -> bool:
    """HF spellings of a dropout probability: ``*dropout*`` (attention_dropout, hidden_dropout,
    hidden_dropout_prob, attention_probs_dropout_prob, resid_dropout, activation_dropout,
    classifier_dropout, embedding_dropout, ffn_dropout, ...), GPT-2's ``*_pdrop`` (attn_pdrop,
    resid_pdrop, embd_pdrop) and ``layerdrop`` (stochastic depth)."""
    return "dropout" in name or name.endswith("_pdrop") or name == "layerdrop"


def disable_dropout(config) -> List[str]:
    """Set every non-zero dropout probability of an HF config (and of its sub-configs, e.g. a
    multimodal model's ``text_config``) to 0; return the dotted names of the fields changed."""
    from transformers import PretrainedConfig

    changed: List[str] = []
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            changed += [f"{name}.{sub}" for sub in disable_dropout(value)]
        elif _is_dropout_field(name) and isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def load_hf_model(path: str, *, attn_implementation: str = "sdpa", value_head: bool = False) -> nn.Module:
    """``AutoModelForCausalLM`` from an HF directory, fp32 master weights, training mode, dropout
    off (module docstring), no embedding ``padding_idx`` (see below). ``value_head``: the critic,
    ``AutoModelForTokenClassification`` with one label (``rl_plugin.models.value_head``): the
    backbone of a causal-LM checkpoint with the scalar head ``score`` at zero, or a value
    checkpoint's own head."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    stored_head = value_head and is_value_config(config)
    if value_head:
        config = value_config(config)
    changed = disable_dropout(config)
    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    model = auto.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation=attn_implementation)
    if value_head and not stored_head:
        with torch.no_grad():
            model.score.weight.zero_()  # V = 0 everywhere until the critic learns
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p != 0:
            module.p = 0.0
            changed.append(f"module {name}")
    if changed:
        logger.info("dropout set to 0 (the old log-probs are taken in eval mode): %s", ", ".join(changed))
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


@dataclass
class FusedRequest:
    """What the next forward of a ``FusedLogProbHead`` returns log-probs for."""

    targets: torch.Tensor
    options: ForwardOptions
    row_index: Optional[torch.Tensor] = None  # rows of the flattened hidden states (padded forms); None: all


class FusedLogProbHead(nn.Module):
    """The model's ``lm_head`` that can return per-token ``(logp, entropy)`` instead of logits.

    Outside ``with head.fused(request):`` it is the plain head (``--fp32-lm-head``: the fp32
    projection). Inside, its forward runs ``fused_log_probs_and_entropy`` on the hidden rows it
    receives and returns ``[1, n, 2]`` (log-prob, entropy) in place of the logits, so the HF
    model's own forward, with FSDP2's unshard of the weight around it (the weight is the full,
    local tensor there, not the sharded DTensor), does the work and ``[n, V]`` never exists. The
    ORIGINAL weight Parameter is held (ties and state-dict names kept); the gradient reaches it
    like any ``nn.Linear``'s.
    """

    def __init__(self, linear: nn.Linear, *, fp32: bool):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fp32 = fp32
        self.request: Optional[FusedRequest] = None

    @contextlib.contextmanager
    def fused(self, request: FusedRequest):
        self.request = request
        try:
            yield
        finally:
            self.request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            if self.fp32:
                return fp32_output_projection(hidden, self.weight, self.bias)
            return nn.functional.linear(hidden, self.weight, self.bias)
        from torch.distributed.tensor import DTensor

        if isinstance(self.weight, DTensor):
            raise RuntimeError(
                "FusedLogProbHead: the weight is a sharded DTensor; call the head inside the FSDP "
                "model's forward (model(**inputs)), where FSDP2 has unsharded it"
            )
        rows = hidden.reshape(-1, hidden.shape[-1])
        if req.row_index is not None:
            rows = rows[req.row_index]
        logp, ent = fused_log_probs_and_entropy(
            rows,
            self.weight,
            req.targets,
            temperature=req.options.temperature,
            fp32_head=self.fp32,
            chunk_size=min(req.options.chunk_size, default_chunk_rows(self.weight.shape[0], device=self.weight.device)),
            with_entropy=req.options.with_entropy,
        )
        return torch.stack([logp, ent], -1).unsqueeze(0)


def install_fused_head(model: nn.Module, *, fp32: bool) -> nn.Module:
    """Replace ``model.lm_head`` (before sharding) by ``FusedLogProbHead`` around the same Parameter."""
    reason = fused_head_unsupported(model)
    if reason is not None:
        raise ValueError(f"fused LM head: {reason}; use --disable-fused-lm-head")
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    model.set_output_embeddings(FusedLogProbHead(head, fp32=fp32))
    if tied and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("fused LM head: replacing the head broke the tie with the input embedding")
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
