"""The base model's identity in a LoRA checkpoint, shared by both backends.

A LoRA checkpoint holds the adapters (and their optimizer state) only, so it means something
only on the base it was trained on. ``base_identity(hf_dir)`` fingerprints that base: sha256 of
its ``config.json`` and of every weight file (``*.safetensors``, ``*.bin``; the embedded tiny
model is an HF directory too, so it is covered the same way). The step directory gets
``lora.json`` = {"lora": rank / alpha / targets, "base": identity} (rank 0, ``write_lora_meta``);
``check_lora_meta`` refuses a load whose base or adapter shape differs, naming both.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional

LORA_META = "lora.json"
WEIGHT_GLOBS = ("*.safetensors", "*.bin")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=8)
def base_identity(hf_dir: str) -> Dict[str, Any]:
    """{"path", "config": sha256, "weights": {file: sha256}} of an HF model directory (cached per process)."""
    d = Path(hf_dir)
    weights = {p.name: _sha256(p) for pattern in WEIGHT_GLOBS for p in sorted(d.glob(pattern))}
    config = _sha256(d / "config.json") if (d / "config.json").is_file() else None
    return {"path": str(d), "config": config, "weights": weights}


def lora_meta(*, rank: int, alpha: float, targets, hf_dir: str) -> Dict[str, Any]:
    return {
        "lora": {"rank": int(rank), "alpha": float(alpha), "targets": sorted(targets)},
        "base": base_identity(str(hf_dir)),
    }


def write_lora_meta(directory: str, meta: Dict[str, Any]) -> str:
    """Write ``lora.json`` into a step directory; returns its name (for ``written_files``)."""
    (Path(directory) / LORA_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return LORA_META


def read_lora_meta(directory: str) -> Optional[Dict[str, Any]]:
    p = Path(directory) / LORA_META
    return json.loads(p.read_text()) if p.is_file() else None


def _same_base(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a.get("config") == b.get("config") and a.get("weights") == b.get("weights")


def check_lora_meta(directory: str, current: Optional[Dict[str, Any]]) -> None:
    """Refuse ``--load directory`` when its LoRA-ness, adapter shape or base model differs from this run's."""
    saved = read_lora_meta(directory)
    if saved is None and current is None:
        return
    if saved is None:
        raise ValueError(
            f"--load {directory}: a full-model checkpoint (no {LORA_META}), this run trains LoRA adapters "
            "(--lora-rank). Fix: resume it without --lora-rank, or start the adapters from a PEFT directory "
            "with --lora-adapter-path"
        )
    if current is None:
        raise ValueError(
            f"--load {directory}: a LoRA checkpoint (adapters only, rank {saved['lora']['rank']}), this run trains "
            f"the whole model. Fix: pass --lora-rank {saved['lora']['rank']} (and the same --target-modules)"
        )
    if saved["lora"]["rank"] != current["lora"]["rank"] or saved["lora"]["targets"] != current["lora"]["targets"]:
        raise ValueError(
            f"--load {directory}: adapters of rank {saved['lora']['rank']} on {saved['lora']['targets']}, this run "
            f"has rank {current['lora']['rank']} on {current['lora']['targets']}. Fix: the same --lora-rank and "
            "--target-modules / --exclude-modules as the run that saved it"
        )
    check_base(directory, saved["base"], current["base"])


def check_base(directory: str, saved: Dict[str, Any], current: Dict[str, Any]) -> None:
    """Refuse adapters saved on the base ``saved`` (a ``base_identity``) for a run on ``current``,
    naming both; the Megatron backend calls it with the identity it keeps in ``common.pt``."""
    if not _same_base(saved, current):
        raise ValueError(
            f"--load {directory}: its adapters were trained on the base model {saved['path']} "
            f"(config sha256 {str(saved['config'])[:12]}, weights {_short(saved['weights'])}), this run's base is "
            f"{current['path']} (config sha256 {str(current['config'])[:12]}, weights {_short(current['weights'])}): "
            "adapters only mean something on their own base. Fix: --hf-checkpoint the base the checkpoint was "
            "trained on"
        )


def _short(weights: Dict[str, str]) -> str:
    return ", ".join(f"{k} {v[:12]}" for k, v in sorted(weights.items())) or "none"
