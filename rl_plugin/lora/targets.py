"""Target resolution: ``--target-modules`` / ``--exclude-modules`` -> the HF projections that get
an adapter.

The unit is the HF projection (PEFT's leaf name), because adapters are named and exported as PEFT
names them on the HF model. A Megatron name stands for the projections fused in that linear:
``linear_qkv`` = q/k/v (one adapter per projection, so a fused linear gets three A/B pairs, not
one over the concatenation), ``linear_fc1`` = gate/up, ``linear_proj`` = o, ``linear_fc2`` = down.
``all-linear`` is every attention and MLP projection, never the LM head or the embeddings.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION + MLP

# Megatron linear -> the HF projections fused in it, in the order megatron-core lays them out.
MEGATRON_FUSED = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_TO_MEGATRON = {hf: mcore for mcore, hfs in MEGATRON_FUSED.items() for hf in hfs}


class UnknownTargetError(ValueError):
    pass


def _names(values: Optional[Iterable[str]]) -> Tuple[str, ...]:
    """Space- or comma-separated names, flattened, order kept, duplicates dropped."""
    out = []
    for value in values or ():
        for name in str(value).split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return tuple(out)


def _expand(name: str, flag: str) -> Tuple[str, ...]:
    if name == "all-linear":
        return ALL_LINEAR
    if name in MEGATRON_FUSED:
        return MEGATRON_FUSED[name]
    if name in ALL_LINEAR:
        return (name,)
    known = ", ".join(("all-linear",) + ALL_LINEAR + tuple(MEGATRON_FUSED))
    raise UnknownTargetError(f"{flag} {name}: not a linear LoRA can target; known: {known}")


def resolve_targets(target_modules: Iterable[str], exclude_modules: Optional[Iterable[str]] = None) -> Tuple[str, ...]:
    """The HF projection names that get adapters, in ``ALL_LINEAR`` order.

    Raises ``UnknownTargetError`` naming the flag and the name for a spelling it does not know,
    and for a selection that leaves nothing to train."""
    chosen = {hf for name in _names(target_modules) for hf in _expand(name, "--target-modules")}
    dropped = {hf for name in _names(exclude_modules) for hf in _expand(name, "--exclude-modules")}
    targets = tuple(hf for hf in ALL_LINEAR if hf in chosen and hf not in dropped)
    if not targets:
        raise UnknownTargetError("--target-modules minus --exclude-modules selects no linear: LoRA would train nothing")
    return targets


def megatron_targets(targets: Iterable[str]) -> dict:
    """Megatron linear name -> the targeted HF projections fused in it (only linears with one)."""
    targets = set(targets)
    return {
        mcore: tuple(hf for hf in hfs if hf in targets)
        for mcore, hfs in MEGATRON_FUSED.items()
        if any(hf in targets for hf in hfs)
    }
