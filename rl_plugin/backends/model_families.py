"""The model families each backend trains: the model ``--hf-checkpoint`` names is one ``--train-backend`` can train, checked from its
``config.json`` before Ray or a model starts (``preflight``), so an unsupported family costs a
second and a message, not a crash inside a train actor.

- Both backends: a checkpoint whose ``architectures`` are all something other than a causal LM
  (a ``...ForSequenceClassification`` reward model, an encoder) is refused: ``AutoModelForCausalLM``
  would load it with a freshly initialised LM head and train noise.
- ``--train-backend megatron``: the ``model_type`` must be a dense model mbridge 0.15.1 converts
  to a megatron-core GPT model (``MEGATRON_MODEL_TYPES``: Llama, Qwen2, Qwen3, and Mistral
  through the Llama bridge); its mixture-of-experts and vision-language bridges and unknown types
  are refused naming the model type, the architecture and the supported types. Mistral with a sliding window shorter than its
  context is refused (megatron's attention here is full attention).
- ``--train-backend fsdp``: any ``model_type`` transformers' ``AutoModelForCausalLM`` maps (or
  a remote-code ``auto_map`` entry for it).

The tables are not mbridge's registry, so this check imports neither mbridge nor megatron
(seconds); ``tests/fast/backends/test_model_families.py`` fails if they and mbridge's text bridges
(``rl_plugin.backends.megatron.bridge.supported_model_types()``) disagree, and runs every
supported type (and Gemma on FSDP) through both backends and both engines.
"""

from __future__ import annotations

from typing import Dict, Optional

MEGATRON_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# mbridge's mixture-of-experts bridges: converted by mbridge, refused here (their layer spec does
# not build without transformer-engine, e.g. a tiny qwen3_moe: "persist_layer_norm not supported
# by torch LayerNorm"; MoE routing, aux losses and expert parallelism are untested in this plugin)
MBRIDGE_MOE_TYPES = ("deepseek_v3", "glm4_moe", "mimo", "mixtral", "qwen2_moe", "qwen3_moe")
# model types converted by another type's mbridge bridge (same layers, same Hugging Face names)
MODEL_TYPE_ALIASES = {"mistral": "llama"}
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _describe(hf_config: Dict) -> str:
    arch = ", ".join(hf_config.get("architectures") or []) or "no architectures in config.json"
    return f"model_type {hf_config.get('model_type')!r} ({arch})"


def not_causal_reason(hf_config: Dict) -> Optional[str]:
    """Why the checkpoint is not a causal LM (its architectures say so), or None."""
    archs = hf_config.get("architectures") or []
    if archs and not any(a.endswith(CAUSAL_SUFFIXES) for a in archs):
        return (
            f"{_describe(hf_config)} is not a causal language model: loaded as one, its LM head would be "
            "freshly initialised (random)"
        )
    return None


def megatron_unsupported_reason(hf_config: Dict) -> Optional[str]:
    """Why the Megatron backend (mbridge) cannot build this model, or None."""
    model_type = hf_config.get("model_type")
    if model_type in MBRIDGE_MOE_TYPES:
        return (
            f"{_describe(hf_config)} is a mixture-of-experts model: mbridge converts it, but the megatron backend "
            f"here builds dense models only; it supports model types: {', '.join(MEGATRON_MODEL_TYPES)}"
        )
    if model_type not in MEGATRON_MODEL_TYPES:
        return (
            f"{_describe(hf_config)} has no mbridge conversion to a megatron-core GPT model (vision-language "
            f"bridges are not used); the megatron backend supports model types: {', '.join(MEGATRON_MODEL_TYPES)}"
        )
    window, context = hf_config.get("sliding_window"), hf_config.get("max_position_embeddings")
    if model_type in MODEL_TYPE_ALIASES and window is not None and (context is None or window < context):
        return (
            f"{_describe(hf_config)} has sliding_window {window} < max_position_embeddings {context}: the megatron "
            "backend has no sliding-window attention (full attention would be another model)"
        )
    return None


def fsdp_unsupported_reason(hf_config: Dict) -> Optional[str]:
    """Why ``AutoModelForCausalLM`` cannot build this model, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if hf_config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    if "AutoModelForCausalLM" in (hf_config.get("auto_map") or {}):
        return None
    return (
        f"{_describe(hf_config)} is not a model type transformers' AutoModelForCausalLM builds, "
        "which the fsdp backend trains"
    )


def unsupported_reason(hf_config: Dict, train_backend: str) -> Optional[str]:
    reason = not_causal_reason(hf_config)
    if reason is None and train_backend == "megatron":
        reason = megatron_unsupported_reason(hf_config)
    if reason is None and train_backend == "fsdp":
        reason = fsdp_unsupported_reason(hf_config)
    return reason
