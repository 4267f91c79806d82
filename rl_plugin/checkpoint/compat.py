"""Is a checkpoint's model the model of this run? Checked tensor by tensor before loading.

A ``--load`` of a checkpoint trained from another model size otherwise fails inside
``load_state_dict`` / DCP with one size-mismatch line per tensor. Both backends call
``check_same_model`` with the checkpoint's tensor shapes and the model's, before loading
anything, and raise one line: which checkpoint, which model, the first tensor that differs
(or is missing / unexpected), how many differ, and the fix.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

Shapes = Dict[str, Tuple[int, ...]]


class CheckpointMismatchError(ValueError):
    pass


def check_same_model(
    ckpt: str, model: Optional[str], saved: Shapes, current: Shapes, *, ignore: Sequence[str] = ()
) -> None:
    skip = set(ignore)
    missing = sorted(k for k in current if k not in saved and k not in skip)
    unexpected = sorted(k for k in saved if k not in current and k not in skip)
    differ = [k for k in current if k in saved and tuple(saved[k]) != tuple(current[k])]
    if not (missing or unexpected or differ):
        return
    if differ:
        k = differ[0]
        first = f"{k} is {tuple(saved[k])} in the checkpoint and {tuple(current[k])} in the model"
    elif missing:
        first = f"the model's {missing[0]} is not in the checkpoint"
    else:
        first = f"the checkpoint's {unexpected[0]} is not in the model"
    counts = f"{len(differ)} tensors differ in shape, {len(missing)} missing, {len(unexpected)} unexpected"
    raise CheckpointMismatchError(
        f"--load {ckpt}: the checkpoint holds another model than --hf-checkpoint {model}: {first} ({counts}). "
        f"Fix: pass the --hf-checkpoint the checkpoint was trained from, or start a new run without --load"
    )
