"""``--save`` / ``--load`` for the Megatron backend: megatron-core ``dist_checkpointing``.

What Megatron-LM writes with ``--ckpt-format torch_dist`` (slime/miles' default): the model's
``sharded_state_dict`` (each tensor a ``ShardedTensor``: its global shape and this rank's slice)
and the optimizer's (Adam moments and fp32 main params keyed by the same global tensors;
the distributed optimizer in ``fully_reshardable`` form, i.e. per-parameter state in model
space, not its internal DP buckets), saved by the torch_dist (DCP) strategy. On load each rank
asks for the slices its own TP x DP x PP layout needs, so a checkpoint written at TP2 x DP1 resumes at
TP1 x DP2, DP2 at DP1, PP2 at PP1 (each stage saves its layers under their global layer number,
megatron-core's ``sharded_state_dict`` offsets), with or without the distributed optimizer.

Files of one step directory (the layout around it is ``rl_plugin.checkpoint``'s, written by the loop:
``iter_*.partial`` while being written, renamed to ``iter_*`` when complete, tracker last)::

    iter_0000012/metadata.json, .metadata, __*.distcp   dist_checkpointing (torch_dist)
    iter_0000012/common.pt                              step, scheduler, layout, the loop's extra
    iter_0000012/rng_rank{r}.pt                         per-rank RNG streams

RNG (``rl_plugin.checkpoint.rng_state`` plus megatron's model-parallel tracker) is per rank; it is
restored only on the layout it was saved on (on another layout there is no rank to continue the
stream of; the run keeps its ``--seed`` seeding, and with dropout 0 the training math uses no
randomness).

The per-rank ``.pt`` format of earlier versions (``rank_*.pt``, nested ``iter_*/rank_*.pt`` +
``latest``) is refused with a message naming it, never partly loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist

from rl_plugin.backends.megatron import lora_checkpoint
from rl_plugin.backends.megatron.chunks import chunks_of
from rl_plugin.backends.megatron.compat.dist_optimizer import (
    allocate_state,
    bucket_aligned_world_state,
    load_optimizer,
    optimizers,
)
from rl_plugin.backends.megatron.lora_model import has_lora
from rl_plugin.checkpoint.compat import check_same_model
from rl_plugin.checkpoint.rng_state import rng_state, set_rng_state
from rl_plugin.checkpoint.written_files import RecordingFileSystemWriter, existing
from rl_plugin.parallel import ParallelState

FORMAT = "rl_plugin/megatron-dist-v1"
MARKER = "metadata.json"  # dist_checkpointing writes it last (serialization.py, metadata_finalize_fn)
MEGATRON_COMMON_FILES = ("common.pt", MARKER)  # rank 0's dist_checkpointing files besides DCP's
# Distributed-optimizer state in model space (per-parameter Adam moments and fp32 main params, the
# shape of the parameter), gathered over DP on gloo (megatron-core 0.16.1 distrib_optimizer.py
# ``sharded_param_state_fully_reshardable``; Megatron-LM's --dist-ckpt-optim-fully-reshardable
# --distrib-optim-fully-reshardable-mem-efficient): reshardable across TP and DP. The NCCL gather
# variant copies through hard-coded ``.cuda()`` (l. 1089), and ``fully_sharded_model_space``
# builds ShardedTensors with ``flattened_range``, which 0.16.1 itself rejects (mapping.py l. 134).
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True}


OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")


class CheckpointFormatError(ValueError):
    """``--load`` of a directory this backend cannot read; the message names it and the fix."""


def _rng_state() -> Dict[str, Any]:
    from megatron.core import tensor_parallel

    return {**rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    set_rng_state(state)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(ps: ParallelState) -> Dict[str, int]:
    return {"tp": ps.tp_size, "cp": ps.cp_size, "dp": ps.dp_size, "pp": ps.pp_size}


def _same_layout(saved: Dict[str, int], ps: ParallelState) -> bool:
    """Whether a saved layout is this run's (checkpoints from before PP carry no ``pp``: 1)."""
    return {"pp": 1, **saved} == _layout(ps)


def _unwrap(model):
    """The module under megatron's DDP (Float16Module forwards ``sharded_state_dict`` to the
    GPTModel), so tensor keys do not depend on ``--bf16``."""
    return model.module


def _model_sharded_state_dict(model) -> Dict[str, Any]:
    """With LoRA, the adapters alone (``lora_checkpoint``: the base is never saved). The model's ``sharded_state_dict``; under the interleaved schedule one per chunk, as
    ``{"model0": ..., "model1": ...}`` (Megatron-LM's nesting). The nesting only shapes the dict
    a load returns: dist_checkpointing matches tensors by key, and each chunk keys its layers by
    their global number (``vp_stage``'s offset), so any PP x VPP layout reads any other's."""
    if has_lora(model):
        return lora_checkpoint.model_sharded_state_dict(model)
    chunks = chunks_of(model)
    if len(chunks) == 1:
        return _unwrap(model).sharded_state_dict()
    return {f"model{v}": _unwrap(chunk).sharded_state_dict() for v, chunk in enumerate(chunks)}


def _load_model_state(model, state) -> None:
    if has_lora(model):
        lora_checkpoint.load_model_state(model, state)
        return
    chunks = chunks_of(model)
    if len(chunks) == 1:
        _unwrap(model).load_state_dict(state)
        return
    for v, chunk in enumerate(chunks):
        _unwrap(chunk).load_state_dict(state[f"model{v}"])


def _sharded_state_dict(model, optimizer, *, is_loading: bool) -> Dict[str, Any]:
    for opt in optimizers(optimizer):
        bucket_aligned_world_state(opt)
    model_sd = _model_sharded_state_dict(model)
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDING),
    }


def _sync_torch_dist_strategy(written: Set[str]):
    """megatron-core's ``torch_dist`` format, written synchronously by this process.

    ``TorchDistSaveShardedStrategy.save`` (0.16.1 strategies/torch.py l. 589) always goes through
    ``FileSystemWriterAsync``: a spawned ``multiprocessing.Manager`` plus forked writer processes
    per save (seconds of start-up, and impossible inside a daemonic process). The bytes on disk
    are plain torch.distributed.checkpoint: the same translation of megatron ShardedTensors
    (``mcore_to_pyt_state_dict``) and the same planner, written with DCP's ``FileSystemWriter``,
    give a checkpoint the default ``torch_dist`` load strategy reads. The DCP files this rank
    wrote (relative paths) are added to ``written``."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            writer = RecordingFileSystemWriter(str(checkpoint_dir), thread_count=1)
            dcp.save(
                mcore_to_pyt_state_dict(sd, False),
                storage_writer=writer,
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
                ),
            )
            written.update(writer.written)

    return SyncTorchDistSave("torch_dist", 1)


def _without_param_state(common: Dict[str, Any]) -> Dict[str, Any]:
    """The common state minus the distributed optimizer's ``param_state``, for megatron's
    every-rank-equal check: gathered on gloo, it exists only on DP rank 0 (None elsewhere), by
    design of the mem-efficient fully_reshardable form; not a divergence to warn about."""
    opt = common.get("optimizer")
    if isinstance(opt, dict) and "param_state" in opt:
        return {**common, "optimizer": {k: v for k, v in opt.items() if k != "param_state"}}
    return common


def save(
    directory: str,
    *,
    step: int,
    model,
    optimizer,
    scheduler,
    ps: ParallelState,
    extra: Optional[Dict] = None,
) -> List[str]:
    """Collective: every rank writes its part of ``step``'s checkpoint into ``directory`` (an
    empty directory, created if missing: the loop's ``iter_*.partial``). Returns the files this
    rank wrote, relative to ``directory`` (its DCP shards, its RNG file; rank 0 also
    dist_checkpointing's ``common.pt`` / ``metadata.json`` and DCP's ``.metadata``)."""
    from megatron.core import dist_checkpointing

    Path(directory).mkdir(parents=True, exist_ok=True)
    allocate_state(optimizer)  # a save before the first step: zeros, as that step would start from
    state = _sharded_state_dict(model, optimizer, is_loading=False)
    # The common part (rank 0 writes it to common.pt; dist_checkpointing checks it is equal on
    # every rank): identical everywhere by construction.
    state.update(format=FORMAT, step=int(step), layout=_layout(ps), scheduler=scheduler.state_dict(), extra=extra or {})
    written: Set[str] = set()
    dist_checkpointing.save(
        state,
        str(directory),
        sharded_strategy=_sync_torch_dist_strategy(written),
        preprocess_common_before_consistancy_check=_without_param_state,
    )
    rng_file = f"rng_rank{dist.get_rank()}.pt"
    torch.save({"layout": _layout(ps), "rng": _rng_state()}, Path(directory) / rng_file)
    written.add(rng_file)
    if dist.get_rank() == 0:  # dist_checkpointing's own files, written by rank 0
        written.update(existing(directory, MEGATRON_COMMON_FILES))
    return sorted(written)


def _check_format(src: Path) -> None:
    """Refuse, by name, a step directory this backend cannot read."""
    if (src / "latest").exists() or any(src.glob("rank_*.pt")) or any(src.glob("iter_*/rank_*.pt")):
        raise CheckpointFormatError(
            f"--load {src}: this is the per-rank .pt format of rl_plugin before megatron-core dist_checkpointing "
            "(rank_*.pt, or iter_*/rank_*.pt + 'latest' nested in the step directory); it is not read any more, so "
            "nothing was loaded. Fix: start again from --hf-checkpoint, or resume it with the rl_plugin version that "
            "wrote it and its exact layout."
        )
    if (src / "meta.pt").exists():
        raise CheckpointFormatError(
            f"--load {src}: it was written by the FSDP backend (torch.distributed.checkpoint + meta.pt). "
            "Fix: resume it with --train-backend fsdp."
        )
    if not (src / MARKER).is_file() or not (src / "common.pt").is_file():
        raise FileNotFoundError(
            f"--load {src}: no complete Megatron checkpoint there ({MARKER} and common.pt of dist_checkpointing are "
            "missing). Fix: pass the --save directory of a run (its latest_checkpointed_iteration.txt names the step)"
        )


def _model_shapes(src: Path, model, ps: ParallelState) -> tuple:
    """``(saved, current)``: global tensor shapes by dist-checkpoint key, of the checkpoint's
    model (its DCP metadata, optimizer entries left out) and of this run's model (every pipeline
    stage's keys: each stage holds its own layers, keyed by their global layer number). Global
    shapes do not depend on the layout, so this compares models, not TP x DP x PP splits."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    meta = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    # optimizer entries: "optimizer.", or "chained_<i>.optimizer." where megatron-core chains one
    # optimizer per parameter kind (an MoE model's expert-parallel parameters get their own)
    saved = {k: tuple(m.size) for k, m in meta.items() if hasattr(m, "size") and not OPTIMIZER_KEY.match(k)}
    sd = _model_sharded_state_dict(model)
    apply_factories(sd)  # e.g. the fused gate/up (SwiGLU) weight under TP: the tensors it is saved as
    current = {t.key: tuple(t.global_shape) for t in nested_values(sd) if isinstance(t, ShardedTensor)}
    if ps.pp_size > 1:  # collective over the pipeline: the union of the stages' tensors
        stages = [None] * ps.pp_size
        dist.all_gather_object(stages, current, group=ps.pp_cpu_group)
        current = {k: v for stage in stages for k, v in stage.items()}
    return saved, current


def _check_optimizer_split(src: Path, optimizer) -> None:
    """megatron-core chains a second optimizer for the expert-parallel parameters of an MoE model
    at --expert-model-parallel-size > 1 (its state keys ``chained_<i>.optimizer.``), one optimizer
    at 1: the state of one cannot be loaded into the other (no key mapping here), so say so."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    saved = len({k.split(".", 1)[0] for k in keys if k.startswith("chained_")}) or 1
    current = len(optimizers(optimizer))
    if saved != current:
        raise CheckpointFormatError(
            f"--load {src}: its optimizer state is in {saved} part(s), this run's optimizer in {current} (megatron-core "
            "splits off the expert-parallel parameters of an MoE model when --expert-model-parallel-size > 1). "
            "Fix: resume with expert parallelism as it was saved (1, or > 1)."
        )


def load(
    directory: str,
    *,
    model,
    optimizer,
    scheduler,
    ps: ParallelState,
    hf_dir: Optional[str] = None,
) -> Dict[str, Any]:
    """Collective: restore model, optimizer, LR schedule (and RNG on the same layout) from one
    complete step directory (``iter_*``); returns ``{"step", "extra"}``."""
    from megatron.core import dist_checkpointing

    src = Path(directory)
    _check_format(src)
    common = torch.load(src / "common.pt", map_location="cpu", weights_only=False)
    if common.get("format") != FORMAT:
        raise CheckpointFormatError(
            f"--load {src}: it is a megatron-core dist checkpoint but not one rl_plugin wrote (format "
            f"{common.get('format')!r}, expected {FORMAT!r}). Fix: convert it to Hugging Face weights and pass them "
            "as --hf-checkpoint."
        )
    check_same_model(str(src), hf_dir, *_model_shapes(src, model, ps))
    _check_optimizer_split(src, optimizer)
    allocate_state(optimizer)
    state = dist_checkpointing.load(_sharded_state_dict(model, optimizer, is_loading=True), str(src))
    _load_model_state(model, state["model"])
    with torch.no_grad():  # fp32 + distributed optimizer: the main param is a view of the model param
        load_optimizer(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_file = src / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, map_location="cpu", weights_only=False)
        if _same_layout(rng["layout"], ps):
            _set_rng_state(rng["rng"])
    return {"step": int(state["step"]), "extra": state["extra"]}
