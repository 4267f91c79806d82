"""Checkpoints of the FSDP backend: torch.distributed.checkpoint (DCP) plus a Hugging Face export.

Files of one step directory (the layout around it is ``rl_plugin.checkpoint``'s, written by the loop:
``iter_*.partial`` while being written, renamed to ``iter_*`` when complete, tracker last)::

    iter_0000003/.metadata, __*.distcp         DCP: {"model": sharded model, "optim": sharded AdamW}
    iter_0000003/rng_rank{r}.pt                per-rank RNG (``rl_plugin.checkpoint.rng_state``)
    iter_0000003/meta.pt                       {"step", "extra" (the loop's state), "backend"}, rank 0
    iter_0000003/lora.json                     LoRA only: rank, alpha, targets, the base's identity, rank 0

With LoRA (``lora_meta`` given) the DCP state holds the adapters and their optimizer state only
(``StateDictOptions(ignore_frozen_params=True)``: the frozen base is the ``--hf-checkpoint``,
fingerprinted in ``lora.json`` by ``rl_plugin.checkpoint.lora_meta``, which refuses a load onto
another base or with another adapter shape; the Megatron backend writes and checks the same file).

DCP writes each rank's shards and reloads them resharded, so a checkpoint saved on DP=2 loads on
DP=1. ``write_hf_dir`` writes full (all-gathered) weights as ``model.safetensors`` with the
model's config (tied duplicates dropped, as ``save_pretrained`` does), stored in the
checkpoint's original dtype, loadable by ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from rl_plugin.checkpoint.compat import check_same_model
from rl_plugin.checkpoint.lora_meta import check_lora_meta, write_lora_meta
from rl_plugin.checkpoint.rng_state import rng_state, set_rng_state
from rl_plugin.checkpoint.written_files import RecordingFileSystemWriter

META = "meta.pt"  # rank 0 writes it after its shards
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _options(lora: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False) if lora else None


def _adapters_only(model_sd: Dict[str, Any], lora: bool) -> Dict[str, Any]:
    """With LoRA, the adapters alone: ``ignore_frozen_params`` keeps a tied alias of a frozen
    weight (``lm_head.weight`` of a tied model, 113 MB at SmolLM2's size), so filter by name too."""
    return {k: v for k, v in model_sd.items() if ".lora_" in k} if lora else model_sd


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    directory: str,
    model,
    optimizer,
    *,
    step: int,
    extra: Optional[Dict[str, Any]] = None,
    backend_state: Optional[Dict[str, Any]] = None,
    lora_meta: Optional[Dict[str, Any]] = None,
) -> List[str]:
    """Collective: every rank writes its shards and RNG state of ``step`` into ``directory`` (an
    empty directory, created if missing: the loop's ``iter_*.partial``); rank 0 adds ``meta.pt``.
    Returns the files this rank wrote, relative to ``directory`` (``rl_plugin.checkpoint.written_files``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    Path(directory).mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(lora_meta is not None))
    model_sd = _adapters_only(model_sd, lora_meta is not None)
    writer = RecordingFileSystemWriter(str(directory))  # DCP's default writer for checkpoint_id=directory
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
    written = set(writer.written) | {f"rng_rank{_rank()}.pt"}
    torch.save(rng_state(), Path(directory) / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        torch.save({"step": int(step), "extra": extra or {}, "backend": backend_state or {}}, Path(directory) / META)
        written.add(META)
        if lora_meta is not None:
            written.add(write_lora_meta(directory, lora_meta))
    return sorted(written)


def load(
    directory: str, model, optimizer, *, hf_dir: Optional[str] = None, lora_meta: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Collective: restore model, optimizer and this rank's RNG from one complete step directory
    (``iter_*``); returns ``meta.pt`` (``{"step", "extra", "backend"}``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    src = Path(directory)
    if (src / "common.pt").is_file():
        raise ValueError(
            f"--load {src}: it was written by the Megatron backend (dist_checkpointing common.pt). "
            "Fix: resume it with --train-backend megatron"
        )
    if not (src / META).is_file():
        raise FileNotFoundError(
            f"--load {src}: no complete FSDP checkpoint there (no {META}). Fix: pass the --save "
            "directory of a run (its latest_checkpointed_iteration.txt names the step)"
        )
    check_lora_meta(str(src), lora_meta)  # LoRA-ness, rank / alpha / targets, the base
    options = _options(lora_meta is not None)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    model_sd = _adapters_only(model_sd, lora_meta is not None)
    saved = {
        k[len("model.") :]: tuple(m.size)
        for k, m in dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata.items()
        if k.startswith("model.") and hasattr(m, "size")
    }  # DCP flattens {"model": sd} to "model.<name>"
    check_same_model(str(src), hf_dir, saved, {k: tuple(v.shape) for k, v in model_sd.items() if torch.is_tensor(v)})
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(src))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    rng_file = src / f"rng_rank{_rank()}.pt"
    if rng_file.exists():  # absent when the world grew since the save: keep this rank's seeding
        set_rng_state(torch.load(rng_file, weights_only=False))
    return torch.load(src / META, weights_only=False)


def write_hf_dir(
    out_dir: str,
    state_dict: Dict[str, torch.Tensor],
    config,
    *,
    source_dir: Optional[str] = None,
    tied_keys=(),
    dtype: torch.dtype = torch.float32,
) -> Path:
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
