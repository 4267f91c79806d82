"""Flags that nothing reads in the chosen configuration: refused when the run would silently train
something else than asked (or fail later inside an actor), warned when harmless.

Two sets of rules, both read ``args`` by argparse dest (so they hold wherever the flags are
declared), and a flag counts as given when its value differs from the parser's default:

- ``check_model_flags(args, config, path)``: against ``--hf-checkpoint``'s ``config.json`` (called
  by ``model_layout.check_model_layout``, so in the flag checker and the trainer's preflight).
  A dense model (no routed experts):
  ``--expert-model-parallel-size > 1`` is refused (megatron-core fails in the train actor ~17 s in);
  the other MoE-only flags (``MOE_ONLY``: router, aux / z loss, dispatcher, expert-TP) are warned:
  nothing reads them, the dense model trains exactly as without them.
- ``check_layout_flags(args)``: the sequence layout. ``--seq-length`` is read only with
  ``--qkv-format bshd`` (the padded length; thd packs samples with no padding), so with thd it is
  warned as unread.

A warning is one ``warning: ...`` line on stderr naming the flag, the configuration and the fix
(``warn``); the trainer prints it once, in its preflight.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, List, Tuple

from rl_plugin.errors import fail

# (flag, dest): read only by MoE layers (megatron-core's router / dispatcher, the FSDP router losses)
MOE_ONLY: Tuple[Tuple[str, str], ...] = (
    ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type"),
    ("--moe-aux-loss-coeff", "moe_aux_loss_coeff"),
    ("--moe-z-loss-coeff", "moe_z_loss_coeff"),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type"),
    ("--moe-router-dtype", "moe_router_dtype"),
)


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    from rl_plugin.arguments import build_parser

    return {a.dest: a.default for a in build_parser()._actions}


def given(args, dest: str) -> bool:
    """``args.<dest>`` differs from the parser's default (absent from ``args``: not given)."""
    if not hasattr(args, dest):
        return False
    return getattr(args, dest) != _defaults().get(dest)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def check_model_flags(args, config: dict, path: Any, experts: int) -> List[str]:
    """Refuse or warn the MoE-only flags on a dense ``config`` (``experts == 0``); returns the
    warnings it printed."""
    if experts:
        return []
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if ep > 1:
        fail(
            f"--expert-model-parallel-size {ep} with {path}",
            f"the model is dense (its config.json names no routed experts: model_type {config.get('model_type')!r}), "
            "so there are no experts to split over expert-parallel ranks (megatron-core would fail in the train actor)",
            "drop --expert-model-parallel-size (data parallelism already uses those ranks), or use an MoE checkpoint",
        )
    unread = [f"{flag} {getattr(args, dest)}" for flag, dest in MOE_ONLY if given(args, dest)]
    if not unread:
        return []
    message = (
        f"{', '.join(unread)} with the dense model {path}: nothing reads these MoE-only flags (its config.json names no "
        "routed experts), so the run trains as without them. Fix: drop them, or use an MoE checkpoint"
    )
    warn(message)
    return [message]


def check_layout_flags(args) -> List[str]:
    """Warn the sequence-layout flags the chosen ``--qkv-format`` does not read; returns the warnings."""
    out = []
    if getattr(args, "qkv_format", "thd") == "thd" and getattr(args, "seq_length", None) is not None:
        out.append(
            f"--seq-length {args.seq_length} with --qkv-format thd: nothing reads it (thd packs samples back to back "
            "with no padding; only --qkv-format bshd pads every sample to --seq-length), and it limits no length (the "
            "model's context and --rollout-max-response-len do). Fix: drop --seq-length, or add --qkv-format bshd"
        )
    for message in out:
        warn(message)
    return out
