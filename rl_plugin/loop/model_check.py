"""Preflight: the model ``--hf-checkpoint`` names is one ``--train-backend`` can train, checked
from its ``config.json`` before Ray or a model starts; the families and the reasons are the
backends' (``rl_plugin.backends.model_families``)."""

from __future__ import annotations

import json
from pathlib import Path

from rl_plugin.backends.model_families import fsdp_unsupported_reason, not_causal_reason, unsupported_reason
from rl_plugin.errors import fail


def check_model_family(hf_checkpoint, train_backend: str) -> None:
    """Preflight: refuse (``RLArgumentError``) a ``--hf-checkpoint`` the backend cannot train.
    Runs after ``validate_paths`` (config.json exists); without ``--hf-checkpoint`` the run
    uses the embedded tiny Qwen2."""
    if not hf_checkpoint:
        return
    path = Path(hf_checkpoint) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        fail(f"--hf-checkpoint {hf_checkpoint}", f"{path} is not readable JSON ({exc})", "re-download the model")
    reason = unsupported_reason(hf_config, train_backend)
    if reason is not None:
        other = "fsdp" if train_backend == "megatron" else None
        fix = "pass a causal LM checkpoint (e.g. ...ForCausalLM)"
        if other and not_causal_reason(hf_config) is None and fsdp_unsupported_reason(hf_config) is None:
            fix = f"train it with --train-backend {other} (any AutoModelForCausalLM), or pass a supported model"
        fail(f"--hf-checkpoint {hf_checkpoint} with --train-backend {train_backend}", reason, fix)
