"""The model families each backend trains: the model ``--hf-checkpoint`` names is one ``--train-backend`` can train, checked from its
``config.json`` before Ray or a model starts (``preflight``), so an unsupported family costs a
second and a message, not a crash inside a train actor.

- Both backends: a checkpoint whose ``architectures`` are all something other than a causal LM
  (a ``...ForSequenceClassification`` reward model, an encoder) is refused: ``AutoModelForCausalLM``
  would load it with a freshly initialised LM head and train noise.
- ``--train-backend megatron``: the ``model_type`` must be one mbridge 0.15.1 converts
  to a megatron-core GPT model (``MEGATRON_MODEL_TYPES``: Llama, Qwen2, Qwen3, Mistral
  through the Llama bridge, and the MoE Qwen2-MoE, Qwen3-MoE, Mixtral); its other
  mixture-of-experts bridges (DeepSeek-V3, GLM-4-MoE, MiMo), its other vision-language bridges and unknown types
  are refused; the vision-language Qwen2.5-VL (``MEGATRON_VL_MODEL_TYPES``) is built by
  ``backends/megatron/vision.py`` through mbridge's own Qwen2.5-VL bridge. Unknown types
  are refused naming the model type, the architecture and the supported types. Mistral with a sliding window shorter than its
  context is refused (megatron's attention here is full attention).
- ``--train-backend fsdp``: any ``model_type`` transformers' ``AutoModelForCausalLM`` maps (or
  a remote-code ``auto_map`` entry for it), and the vision-language Qwen2-VL / Qwen2.5-VL
  (``VL_MODEL_TYPES``, built by ``AutoModelForImageTextToText``; ``backends/fsdp/vision.py``).

The tables are not mbridge's registry, so this check imports neither mbridge nor megatron
(seconds); ``tests/fast/backends/test_model_families.py`` fails if they and mbridge's text bridges
(``rl_plugin.backends.megatron.bridge.supported_model_types()``) disagree, and runs every
supported type (and Gemma on FSDP) through both backends and both engines.
"""

from __future__ import annotations

from typing import Dict, Optional

from rl_plugin.models.vl_processor import VL_MODEL_TYPES

# dense, and the mixture-of-experts models megatron-core builds here with sequential experts
# (``rl_plugin.backends.megatron.moe``; tested on both backends, with expert parallelism)
MEGATRON_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
# mbridge's other mixture-of-experts bridges: converted by mbridge, refused here (multi-latent
# attention, expert bias and MTP layers are untested in this plugin)
MBRIDGE_MOE_TYPES = ("deepseek_v3", "glm4_moe", "mimo")
# model types converted by another type's mbridge bridge (same layers, same Hugging Face names)
MODEL_TYPE_ALIASES = {"mistral": "llama"}
# vision-language: mbridge's Qwen2.5-VL on the local specs (``backends/megatron/vision.py``)
MEGATRON_VL_MODEL_TYPES = ("qwen2_5_vl",)
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
            f"{_describe(hf_config)} is a mixture-of-experts model mbridge converts, but the megatron backend "
            f"here does not build it (untested); it supports model types: {', '.join(MEGATRON_MODEL_TYPES)}"
        )
    if model_type in MEGATRON_VL_MODEL_TYPES:
        return None
    if model_type not in MEGATRON_MODEL_TYPES:
        return (
            f"{_describe(hf_config)} has no mbridge conversion to a megatron-core GPT model (of the "
            f"vision-language bridges only {', '.join(MEGATRON_VL_MODEL_TYPES)} is used); the megatron backend "
            f"supports model types: {', '.join(MEGATRON_MODEL_TYPES + MEGATRON_VL_MODEL_TYPES)}"
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

    if (
        hf_config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or hf_config.get("model_type") in VL_MODEL_TYPES
    ):
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
