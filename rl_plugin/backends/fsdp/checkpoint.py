"""Checkpoints of the FSDP backend: torch.distributed.checkpoint (DCP) plus a Hugging Face export.

Layout of ``--save DIR`` (Megatron-LM's tracker name, so tooling that reads it keeps working)::

    DIR/latest_checkpointed_iteration.txt      the last complete step (written last, by rank 0)
    DIR/iter_0000003/                          DCP: {"model": sharded model, "optim": sharded AdamW}
    DIR/iter_0000003/rng_rank{r}.pt            per-rank RNG (python, numpy, torch CPU, CUDA)
    DIR/iter_0000003/meta.pt                   {"step", "extra" (the loop's state), "backend"}, rank 0

When ``path`` already is the step's directory (its name is ``iter_{step:07d}``, as the loop's
``rl_plugin.loop.checkpoint.step_dir`` passes it), the files go straight into it and no tracker is
written (the loop writes its own once every rank returned). ``load`` accepts either form.

DCP writes each rank's shards and reloads them resharded, so a checkpoint saved on DP=2 loads on
DP=1. ``write_hf_dir`` writes full (all-gathered) weights as ``model.safetensors`` with the
model's config (tied duplicates dropped, as ``save_pretrained`` does), stored in the
checkpoint's original dtype, loadable by ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def iter_dir(root: str, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: str, model, optimizer, *, step: int, extra: Optional[Dict[str, Any]] = None,
         backend_state: Optional[Dict[str, Any]] = None) -> Path:
    """Collective: every rank writes its shards; rank 0 writes meta and, last, the tracker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    as_step_dir = Path(root).name == iter_dir(root, step).name
    out = Path(root) if as_step_dir else iter_dir(root, step)
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out))
    torch.save(rng_state(), out / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        torch.save({"step": int(step), "extra": extra or {}, "backend": backend_state or {}}, out / "meta.pt")
    _barrier()
    if _rank() == 0 and not as_step_dir:
        tmp = Path(root) / (TRACKER + ".tmp")
        tmp.write_text(str(int(step)))
        os.replace(tmp, Path(root) / TRACKER)  # atomic: a crash never leaves a half-written pointer
    _barrier()
    return out


def resolve(path: str) -> Path:
    """``path`` may be a ``--save`` root (its tracker names the step) or an ``iter_*`` directory."""
    p = Path(path)
    if (p / TRACKER).exists():
        return iter_dir(str(p), int((p / TRACKER).read_text().strip()))
    if (p / "meta.pt").exists():
        return p
    raise FileNotFoundError(f"--load {path}: neither a checkpoint root with {TRACKER} nor an iter_* checkpoint directory")


def load(path: str, model, optimizer, *, hf_dir: Optional[str] = None) -> Dict[str, Any]:
    """Collective: restore model, optimizer and this rank's RNG; returns ``{"step", "extra"}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from rl_plugin.backends.checkpoint_compat import check_same_model

    src = resolve(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    saved = {k[len("model."):]: tuple(m.size) for k, m in dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}  # DCP flattens {"model": sd} to "model.<name>"
    check_same_model(str(src), hf_dir, saved, {k: tuple(v.shape) for k, v in model_sd.items() if torch.is_tensor(v)})
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(src))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = src / f"rng_rank{_rank()}.pt"
    if rng_file.exists():  # absent when the world grew since the save: keep this rank's seeding
        set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(src / "meta.pt", weights_only=False)


def write_hf_dir(out_dir: str, state_dict: Dict[str, torch.Tensor], config, *, source_dir: Optional[str] = None,
                 tied_keys=(), dtype: torch.dtype = torch.float32) -> Path:
    """Rank 0 writes ``config.json`` + ``model.safetensors`` and copies the other files of
    ``source_dir`` (tokenizer, generation config); collective (ends with a barrier)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in state_dict.items() if k not in set(tied_keys)}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(out))
        # Tokenizer, generation config, chat template...: every file of the source directory
        # except its weights and its config (both written above).
        for src in sorted(Path(source_dir).iterdir()) if source_dir else ():
            if src.is_file() and src.name != "config.json" and not src.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy(src, out / src.name)
    _barrier()
    return out
