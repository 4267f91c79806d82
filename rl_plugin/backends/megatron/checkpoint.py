"""``--save`` / ``--load`` for the Megatron backend: model + optimizer + LR schedule + RNG + step.

Layout: ``DIR/iter_{step:07d}/rank_{rank:05d}.pt`` (one file per rank: its model shard, its
optimizer state, and its RNG streams) plus ``DIR/latest`` (the step, written by rank 0 after every
rank has written). With ``--use-distributed-optimizer`` each rank stores its DP shard of the
optimizer state (``get_parameter_state_dp_reshardable``). A resumed run therefore needs the same
TP x CP x DP layout; ``load`` checks it and says so. (Resharding to another layout would go
through megatron-core ``dist_checkpointing``; not done yet.)

RNG: torch CPU (and CUDA when present), Python ``random``, NumPy, and megatron's model-parallel
RNG tracker states, so dropout and sampling continue the same streams.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from rl_plugin.backends.checkpoint_compat import check_same_model
from rl_plugin.parallel import ParallelState


def _optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt) -> bool:
    return hasattr(opt, "get_parameter_state_dp_reshardable")


def _rng_state() -> Dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _mark_unpadded(param_state: Dict) -> Dict:
    """megatron-core 0.16.1: ``get_parameter_state_dp_reshardable`` (distrib_optimizer.py l. 942)
    writes bucket entries without the ``padding`` key that ``load_parameter_state_from_dp_reshardable``
    (l. 1790) filters on (only the dist_checkpointing path adds it). Every entry it writes is a
    real parameter, so mark them unpadded."""
    for key, dtype_state in param_state.items():
        if isinstance(key, int):
            for buckets in dtype_state.values():
                for bucket in buckets:
                    for elem in bucket:
                        elem.setdefault("padding", False)
    return param_state


def _unalias_step_tensors(opt) -> None:
    """megatron-core 0.16.1 ``DistributedOptimizer.load_state_dict`` gives every parameter of a
    group the SAME ``step`` tensor object; torch Adam then increments it once per parameter per
    step, and the bias correction of a resumed run drifts (found by the resume test). Give each
    parameter its own copy before the per-parameter values are loaded."""
    inner = getattr(opt, "optimizer", None)
    for state in getattr(inner, "state", {}).values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def _shapes(sd) -> Dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in sd.items() if torch.is_tensor(v)}


def _layout(ps: ParallelState) -> Dict[str, int]:
    return {"tp": ps.tp_size, "cp": ps.cp_size, "dp": ps.dp_size}


def save(path: str, *, step: int, model, optimizer, scheduler, ps: ParallelState, extra: Optional[Dict] = None) -> str:
    """Collective: every rank writes its file; returns the step directory."""
    rank = dist.get_rank()
    step_dir = Path(path) / f"iter_{int(step):07d}"
    step_dir.mkdir(parents=True, exist_ok=True)
    opts = _optimizers(optimizer)
    state = {
        "step": int(step),
        "layout": _layout(ps),
        "model": model.state_dict(),
        "optimizer": [o.state_dict() for o in opts],
        "optimizer_param_state": [o.get_parameter_state_dp_reshardable() if _is_distributed(o) else None for o in opts],
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
        "extra": extra or {},
    }
    tmp = step_dir / f"rank_{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, step_dir / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (Path(path) / "latest").write_text(str(int(step)))
    dist.barrier()
    return str(step_dir)


def load(path: str, *, model, optimizer, scheduler, ps: ParallelState, hf_dir: Optional[str] = None) -> Dict[str, Any]:
    """Restore what ``save`` wrote at ``DIR/latest``; returns ``{"step", "extra"}``."""
    latest = Path(path) / "latest"
    if not latest.exists():
        raise FileNotFoundError(f"--load {path}: no 'latest' file there (no checkpoint was saved to this directory)")
    step = int(latest.read_text().strip())
    file = Path(path) / f"iter_{step:07d}" / f"rank_{dist.get_rank():05d}.pt"
    if not file.exists():
        raise FileNotFoundError(f"--load {path}: {file} is missing (saved with fewer ranks?)")
    state = torch.load(file, map_location="cpu", weights_only=False)
    if state["layout"] != _layout(ps):
        raise ValueError(
            f"--load {path}: saved with layout {state['layout']}, this run is {_layout(ps)}. "
            "Fix: resume with the same --tensor-model-parallel-size, --context-parallel-size and world size."
        )
    check_same_model(str(file), hf_dir, _shapes(state["model"]), _shapes(model.state_dict()))
    model.load_state_dict(state["model"])
    for opt, sd, param_state in zip(_optimizers(optimizer), state["optimizer"], state["optimizer_param_state"]):
        opt.load_state_dict(sd)
        if param_state is not None:
            _unalias_step_tensors(opt)
            with torch.no_grad():  # fp32 params: the main param is a view of the model param
                opt.load_parameter_state_from_dp_reshardable(_mark_unpadded(param_state))
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return {"step": state["step"], "extra": state["extra"]}
