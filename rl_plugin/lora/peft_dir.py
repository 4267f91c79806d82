"""A PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``.

``write_peft_dir(out, adapters, ...)`` writes canonical-named adapter tensors
(``...q_proj.lora_A.weight``) under PEFT's file keys (``names.peft_file_name``:
``base_model.model.`` + the canonical name) with the config fields PEFT reads back
(``peft_type LORA``, ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``bias none``),
so ``peft.PeftModel.from_pretrained(base, out)`` loads it. No ``peft`` import: both backends and
the rollout engines (vLLM's ``LoRARequest`` reads such a directory) write it.
``read_peft_dir(path)`` gives back ``(config dict, {canonical name: tensor})``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple, Union

from rl_plugin.lora.names import canonical_name, peft_file_name

if TYPE_CHECKING:  # no torch import at parse time (configs.lora reads missing_files)
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(
    rank: int, alpha: float, dropout: float, targets: Union[str, Sequence[str]], base_model: Optional[str] = None
) -> dict:
    """PEFT's fields; ``targets``: leaf names, or one regex over module paths (a VL model's LM)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": targets if isinstance(targets, str) else sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def write_peft_dir(
    out_dir: str,
    adapters: Dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Union[str, Sequence[str]],
    base_model: Optional[str] = None,
    dtype: Optional["torch.dtype"] = None,
) -> Path:
    """Write the directory (created if missing); ``adapters``: canonical name -> full tensor
    (stored as ``dtype``, default fp32)."""
    import torch
    from safetensors.torch import save_file

    dtype = dtype or torch.float32
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {peft_file_name(k): v.detach().to("cpu", dtype).contiguous() for k, v in adapters.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(rank, alpha, dropout, targets, base_model)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def write_run_adapters(
    out_dir: str,
    adapters: Dict[str, "torch.Tensor"],
    lora,
    base_model: Optional[str],
    target_modules: Union[str, Sequence[str], None] = None,
) -> Path:
    """``--save-hf`` of a LoRA run: ``adapters`` as the run's ``LoraConfig`` (``lora``) trained
    them (targets resolved from ``--target-modules`` / ``--exclude-modules``, or
    ``target_modules`` as the backend gave them to PEFT: a VL model's regex)."""
    from rl_plugin.lora.targets import resolve_targets

    return write_peft_dir(
        out_dir,
        adapters,
        rank=lora.lora_rank,
        alpha=lora.lora_alpha,
        dropout=lora.lora_dropout,
        targets=target_modules or resolve_targets(lora.target_modules, lora.exclude_modules),
        base_model=base_model,
    )


def missing_files(path: str) -> Tuple[str, ...]:
    """The files of a PEFT adapter directory that ``path`` lacks."""
    return tuple(f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (Path(path) / f).is_file())


def read_peft_dir(path: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads((Path(path) / CONFIG_FILE).read_text())
    return config, {canonical_name(k): v for k, v in load_file(str(Path(path) / WEIGHTS_FILE)).items()}
