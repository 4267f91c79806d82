"""OptimizerConfig: the optimizer and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, Bounds, Declared, flag


@dataclass(frozen=True)
class OptimizerConfig(Declared):
    """The optimizer and its learning-rate schedule (Megatron-LM's flags, spelled and defaulted as
    Megatron-LM does; declared here, added to our parser only when Megatron-LM's is absent)."""

    optimizer: str = flag(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="Optimizer (Megatron-LM). adam (AdamW with --weight-decay) for training; sgd makes the update linear in the gradient (parity tests, debugging).",
        **MEGATRON,
    )
    lr: float = flag(
        "--lr",
        type=float,
        default=1e-6,
        help="Peak learning rate (Megatron-LM).",
        bounds=Bounds(0.0, "--lr 1e-6"),
        **MEGATRON,
    )
    min_lr: float = flag(
        "--min-lr",
        type=float,
        default=0.0,
        help="Minimum learning rate of the decay schedule (Megatron-LM).",
        bounds=Bounds(0.0, "--min-lr 0"),
        **MEGATRON,
    )
    lr_decay_style: str = flag(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
        default="constant",
        help="Learning-rate decay (Megatron-LM). RL recipes mostly use constant.",
        **MEGATRON,
    )
    lr_warmup_iters: int = flag(
        "--lr-warmup-iters",
        type=int,
        default=0,
        help="Linear warm-up steps (Megatron-LM).",
        bounds=Bounds(0, "--lr-warmup-iters 0"),
        **MEGATRON,
    )
    lr_decay_iters: Optional[int] = flag(  # required (checked) unless constant
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Steps over which the learning rate decays (Megatron-LM).",
        bounds=Bounds(1, "--lr-decay-iters 1000"),
        **MEGATRON,
    )
    weight_decay: float = flag(
        "--weight-decay",
        type=float,
        default=0.0,
        help="Decoupled weight decay (AdamW) (Megatron-LM).",
        bounds=Bounds(0.0, "--weight-decay 0.01"),
        **MEGATRON,
    )
    sgd_momentum: float = flag(
        "--sgd-momentum",
        type=float,
        default=0.9,
        help="SGD momentum with --optimizer sgd (Megatron-LM default 0.9).",
        bounds=Bounds(0.0, "--sgd-momentum 0.9", high=1.0),
        **MEGATRON,
    )
    adam_beta1: float = flag(
        "--adam-beta1",
        type=float,
        default=0.9,
        help="Adam beta1 (Megatron-LM).",
        bounds=Bounds(0.0, "--adam-beta1 0.9", high=1.0),
        **MEGATRON,
    )
    adam_beta2: float = flag(
        "--adam-beta2",
        type=float,
        default=0.98,
        help="Adam beta2 (Megatron-LM; RL recipes use 0.98).",
        bounds=Bounds(0.0, "--adam-beta2 0.98", high=1.0),
        **MEGATRON,
    )
    adam_eps: float = flag(
        "--adam-eps",
        type=float,
        default=1e-8,
        help="Adam epsilon (Megatron-LM).",
        bounds=Bounds(0.0, "--adam-eps 1e-8", low_open=True),
        **MEGATRON,
    )
    clip_grad: float = flag(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Global gradient-norm clip; 0 disables (Megatron-LM).",
        bounds=Bounds(0.0, "--clip-grad 1.0 (0 disables clipping)"),
        **MEGATRON,
    )
    use_distributed_optimizer: bool = flag(  # ZeRO-1 over DP (Megatron backend)
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state over data-parallel ranks (Megatron-LM, ZeRO-1).",
        **MEGATRON,
    )

    def check(self, run) -> None:
        decay_style = self.lr_decay_style
        if decay_style != "constant" and self.lr_decay_iters is None:
            fail(
                f"--lr-decay-style {decay_style}",
                "the decay schedule needs its length, and an RL run has no --train-iters to default it to "
                "(it would otherwise silently never decay)",
                "pass --lr-decay-iters N (optimizer steps), or use --lr-decay-style constant",
            )
        lr, min_lr = self.lr, self.min_lr
        if lr is not None and min_lr is not None and min_lr > lr:
            fail(
                f"--min-lr {min_lr} with --lr {lr}",
                "the decay schedule ends at --min-lr, so it must not exceed the peak --lr",
                f"use --min-lr <= {lr}",
            )
