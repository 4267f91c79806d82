"""A LoRA checkpoint's metadata, written and checked in one place for both backends.

A LoRA checkpoint holds the adapters (and their optimizer state) only, so it means something only
with the adapter shape it was trained at and on the base it was trained on. Rank 0 of either
backend writes ``lora.json`` into the step directory (``write_lora_meta``)::

    {"lora": {"rank": r, "alpha": alpha, "targets": [sorted HF projection names]},
     "base": {"path", "config": sha256, "weights": {file: sha256}}}

``lora_meta(lora_cfg, hf_dir)`` is this run's (None without LoRA); ``base_identity(hf_dir)``
fingerprints the base: sha256 of its ``config.json`` and of every weight file (``*.safetensors``,
``*.bin``; the embedded tiny model is an HF directory too, so it is covered the same way).

``check_lora_meta(directory, current)`` refuses a ``--load`` whose LoRA-ness, adapter shape
(rank, alpha, targets: each changes what the saved ``B A`` means; a changed alpha silently
rescales the adapter's delta ``(alpha / r) B A``) or base differs from this run's, naming both
values and the flags that resume it. ``--lora-dropout`` is not compared: it changes the training
forward, not what the adapters are, so a resume may change it.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional

from rl_plugin.lora.targets import resolve_targets

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


def lora_meta(lora_cfg, hf_dir) -> Optional[Dict[str, Any]]:
    """This run's ``lora.json`` (module docstring) from its ``LoraConfig``; None without LoRA."""
    if lora_cfg is None or not lora_cfg.enabled:
        return None
    targets = resolve_targets(lora_cfg.target_modules, lora_cfg.exclude_modules)
    return {
        "lora": {"rank": int(lora_cfg.lora_rank), "alpha": float(lora_cfg.lora_alpha), "targets": sorted(targets)},
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


class LoraCheckpointError(ValueError):
    """A ``--load`` whose adapters do not fit this run; the message names both sides and the fix."""


def check_lora_meta(directory: str, current: Optional[Dict[str, Any]]) -> None:
    """Refuse ``--load directory`` when its LoRA-ness, adapter shape (rank, alpha, targets) or
    base model differs from this run's ``current`` (``lora_meta``; None: no LoRA)."""
    saved = read_lora_meta(directory)
    if saved is None and current is None:
        return
    if saved is None:
        raise LoraCheckpointError(
            f"--load {directory}: a full-model checkpoint (no {LORA_META}), this run trains LoRA adapters "
            "(--lora-rank). Fix: resume it without --lora-rank, or start the adapters from a PEFT directory "
            "with --lora-adapter-path"
        )
    if current is None:
        raise LoraCheckpointError(
            f"--load {directory}: a LoRA checkpoint (adapters only), this run trains the whole model (no "
            f"--lora-rank). Fix: resume it with {_flags(saved['lora'])}"
        )
    was, now = saved["lora"], current["lora"]
    differ = [
        f"{flag} {_shown(was.get(key))} in the checkpoint, {_shown(now[key])} in this run"
        for flag, key in (("--lora-rank", "rank"), ("--lora-alpha", "alpha"), ("--target-modules", "targets"))
        if _norm(key, was.get(key)) != _norm(key, now[key])
    ]
    if differ:
        raise LoraCheckpointError(
            f"--load {directory}: its LoRA adapters were trained with other settings: {'; '.join(differ)}. "
            "The saved adapters mean (alpha / r) B A on those linears only: another rank or target set does not "
            "fit them, another alpha would silently rescale their update. Fix: resume with the checkpoint's "
            f"{_flags(was)}"
        )
    check_base(directory, saved["base"], current["base"])


def _norm(key: str, value: Any) -> Any:
    if key == "targets":
        return sorted(value or ())
    return None if value is None else float(value)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(value)
    return "(not recorded)" if value is None else f"{value:g}"


def _flags(lora: Dict[str, Any]) -> str:
    """The flags that give the adapter shape ``lora`` (a ``lora.json``'s "lora")."""
    return (
        f"--lora-rank {lora['rank']} --lora-alpha {_shown(lora.get('alpha'))} "
        f"--target-modules {' '.join(lora['targets'])}"
    )


def check_base(directory: str, saved: Dict[str, Any], current: Dict[str, Any]) -> None:
    """Refuse adapters saved on the base ``saved`` (a ``base_identity``) for a run on ``current``,
    naming both."""
    if not _same_base(saved, current):
        raise LoraCheckpointError(
            f"--load {directory}: its adapters were trained on the base model {saved['path']} "
            f"(config sha256 {str(saved['config'])[:12]}, weights {_short(saved['weights'])}), this run's base is "
            f"{current['path']} (config sha256 {str(current['config'])[:12]}, weights {_short(current['weights'])}): "
            "adapters only mean something on their own base. Fix: --hf-checkpoint the base the checkpoint was "
            "trained on"
        )


def _short(weights: Dict[str, str]) -> str:
    return ", ".join(f"{k} {v[:12]}" for k, v in sorted(weights.items())) or "none"
