"""The critic's Hugging Face form: a causal LM's backbone with a scalar head, as transformers'
``<Family>ForTokenClassification`` with one label (the form verl's critic exports).

Names: the backbone under ``model.`` (``model.embed_tokens.weight``, ``model.layers.*``,
``model.norm.weight``) and the head ``score.weight`` ``[1, hidden]``, no bias
(``token_classification_bias: false``): V(s_t) = score . h_t, h_t the final hidden state at
position t. A value model starts from a causal-LM checkpoint with the head at ZERO (every value 0,
so the first advantages are the returns), or from a token-classification checkpoint with one label
(a critic exported here, or ``--critic-load``'s HF form) with its head as stored.

``value_config`` turns a causal LM's config into the critic's; ``write_value_hf_dir`` writes a
directory ``AutoModelForTokenClassification.from_pretrained`` loads (both backends' export).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch

HEAD = "score.weight"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def token_classification_class(model_type: str) -> str:
    """transformers' token-classification class name of ``model_type`` (e.g. ``qwen2`` ->
    ``Qwen2ForTokenClassification``); a family without one is refused, naming it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES as NAMES

    name = NAMES.get(model_type)
    if name is None:
        raise ValueError(
            f"the critic (--advantage-estimator ppo) is the model as <Family>ForTokenClassification; "
            f"transformers has no such class for model_type {model_type!r}. Fix: train the critic on a "
            "family that has one (qwen2, qwen3, llama, mistral, gemma, qwen2_moe, qwen3_moe, mixtral, ...)"
        )
    return name


def is_value_config(config) -> bool:
    """Whether an HF config is already the critic's (a token-classification model, one label)."""
    archs = list(getattr(config, "architectures", None) or ())
    return bool(archs) and archs[0].endswith("ForTokenClassification") and int(config.num_labels) == 1


def value_config(config):
    """A copy of ``config`` as the critic's: one label, no head bias, no classifier dropout,
    ``architectures = [<Family>ForTokenClassification]``."""
    out = copy.deepcopy(config)
    out.num_labels = 1  # sets id2label / label2id to one label
    out.token_classification_bias = False
    out.classifier_dropout = 0.0
    out.architectures = [token_classification_class(out.model_type)]
    return out


def write_value_hf_dir(
    out_dir: str,
    state_dict: Dict[str, torch.Tensor],
    config,
    *,
    source_dir: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``config.json`` (``value_config`` of ``config``) and ``model.safetensors`` (the
    token-classification names, in ``dtype``) to ``out_dir``, with the other files of
    ``source_dir`` (tokenizer, chat template). Not collective: the caller writes on one rank."""
    from safetensors.torch import save_file

    if HEAD not in state_dict or tuple(state_dict[HEAD].shape)[0] != 1:
        raise ValueError(f"write_value_hf_dir: the state dict has no {HEAD} of shape [1, hidden]")
    stray = sorted(k for k in state_dict if k != HEAD and not k.startswith("model."))
    if stray:
        raise ValueError(f"write_value_hf_dir: names outside model.* and {HEAD}: {stray[:3]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    value_config(config).save_pretrained(str(out))
    for src in sorted(Path(source_dir).iterdir()) if source_dir else ():
        if src.is_file() and src.name != "config.json" and not src.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(src, out / src.name)
    return out
