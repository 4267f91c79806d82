"""Every flag of rl_plugin, grouped by concern, with its validation beside it.

- ``add_rl_arguments(parser) -> parser``: adds the RL flags. Works on our own parser and as
  Megatron-LM's ``extra_args_provider`` (flags Megatron-LM already defines are not redefined).
- ``validate_rl_args(args)``: phase 1, static checks: builds the typed tree of ``args``
  (``rl_plugin.configs.run.RunConfig``) and runs every config's rules on it; raises
  ``RLArgumentError`` naming the flags, the rule and the fix; then writes the derived settings once
  (``--calculate-per-token-loss`` <=> ``--loss-aggregation token_mean``). The rules read config
  instances, never ``args``, so their order is free.
- ``validate_world(args, dp_size=...)``: phase 2, checks that need the world (DP size).
- ``build_parser()``: our standalone parser = Megatron-LM compat flags + RL flags.

Flags are declared on the typed configs (``rl_plugin.flags``: a dataclass field carries its flag,
default, help, choices and range); ``_configs()`` lists the classes that declare flags (the run
config's tree), and ``GROUPS`` the ``--help`` sections in the order a user reads them (the run, then
the objective, then the machinery). A config's rules are its methods ``check(run)`` (and
``check_world(run, dp_size=...)``) on the built tree; ranges are declared on the field (``bounds``). Each flag is defined once
(``_util.add_flag`` raises on a second rl_plugin definition).
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from rl_plugin.arguments._util import RLArgumentError, add_flag
from rl_plugin.flags import declared_flags

# The --help sections, in order: (title, description). A declared flag names its section.
GROUPS = (
    ("megatron", "Megatron-LM flags (defined here only when Megatron-LM's parser is absent)"),
    ("training backend", "Which backend trains, and from which Hugging Face checkpoint."),
    ("rollout", "Prompts, group sizes, sampling and evaluation of the RL loop."),
    ("engine", "The generation engine: which one, its size, and a debug hook on its log-probs."),
    (
        "rewards",
        "How a sample is scored: a built-in verifier, your function (per sample or per group), or a remote reward model.",
    ),
    (
        "custom generation",
        "slime's rollout hooks: multi-turn and tool-using generation, or a whole rollout of your own.",
    ),
    (
        "dynamic sampling",
        "DAPO's rollout control: over-sample and keep the groups a filter passes; soft over-long shaping.",
    ),
    ("batching", "How rollouts become optimizer steps and micro-batches."),
    ("policy loss", "Advantage estimator, clipping, KL and entropy terms."),
    (
        "critic",
        "PPO with a learned value model (--advantage-estimator ppo): GAE advantages, the critic's size, learning rate and checkpoints.",
    ),
    ("sft and distillation", "Supervised fine-tuning (--loss-type sft_loss) and on-policy distillation (--use-opd)."),
    ("loss aggregation", "How per-token policy losses become the step objective J."),
    ("off-policy correction", "Importance sampling between the rollout engine and the trainer; DeepSpeed parity."),
    (
        "true on-policy",
        "The engine's and the trainer's log-probs bitwise equal (one op library); bit-reproducible reruns.",
    ),
    ("log-probs", "How training log-probs are computed from logits."),
    ("metrics", "What the policy-gradient step reports."),
    ("moe", "Mixture-of-experts models (Megatron-LM spellings)."),
    (
        "routing replay",
        "Mixture-of-experts routing replay: the trainer routes each token to the experts the engine (R3) or the old-policy pass (R2) routed it to.",
    ),
    (
        "lora",
        "Low-rank adapters: train W + (alpha/r) B A on frozen linears; only the adapters train, sync and checkpoint.",
    ),
    ("fsdp backend", "Settings read only by --train-backend fsdp (PyTorch FSDP2 on the Hugging Face model)."),
    ("weight sync", "How the trainer's weights reach the rollout engines after every rollout."),
    (
        "overlapped training",
        "Generate rollout k+1 while the trainer trains on rollout k (one-step off-policy), or fully asynchronously (--fully-async).",
    ),
    ("cluster", "Ray placement of the training ranks and the rollout engine."),
    (
        "checkpointing",
        "Which checkpoint to resume, which to keep, and the guard against overwriting a run's (--save, --load and --save-interval are Megatron-LM's).",
    ),
    ("fault tolerance", "What the loop does when a worker dies mid-run, and how it stops when asked to."),
    ("logging", "Where the loop's metrics go."),
)
MEGATRON_GROUP = "megatron"


def _configs():
    """The config classes that declare flags: the run config's tree (``configs.run.config_classes``),
    depth first in field order, which is also the order of the flags inside each ``--help`` section
    (``declared_flags`` reads one class's own fields, so a nested config is listed itself)."""
    from rl_plugin.configs.run import RunConfig, config_classes

    return tuple(c for c in config_classes(RunConfig) if c is not RunConfig)


def _add_declared(parser: argparse.ArgumentParser, *, megatron: bool) -> None:
    """Add the declared flags of the sections in ``GROUPS`` (only Megatron-LM's, or only ours)."""
    specs = [spec for cls in _configs() for _, spec in declared_flags(cls) if spec.megatron == megatron]
    titles = {title for title, _ in GROUPS}
    for spec in specs:
        if spec.group not in titles:
            raise ValueError(f"{spec.names[0]} names the --help section {spec.group!r}, which GROUPS lacks")
    for title, description in GROUPS:
        mine = [s for s in specs if s.group == title]
        if mine:
            group = next((g for g in parser._action_groups if g.title == title), None)
            group = group or parser.add_argument_group(title, description)
            for spec in mine:
                add_flag(group, *spec.names, **spec.argparse_kwargs())


def add_rl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_declared(parser, megatron=False)
    return parser


def run_config_of(args: argparse.Namespace, *, load_user_code: bool = False):
    """The typed tree of ``args`` (``rl_plugin.configs.run.RunConfig``): without the user functions
    by default (the tree the rules check; the loop builds its own once, with them)."""
    from rl_plugin.configs.run import RunConfig

    return RunConfig.from_args(args, load_user_code=load_user_code)


def validate_rl_args(args: argparse.Namespace) -> argparse.Namespace:
    """Phase 1: the tree of ``args`` is built and every config's rules check it
    (``rl_plugin.configs.run.check``), then the derived settings are written once.

    A rule reads the config instances (its own fields, the others' through the tree), never
    another rule's result, so the rules can run in any order; ``_resolve`` then writes the one
    derived setting Megatron-LM's own code reads off the namespace. Idempotent."""
    from rl_plugin.configs.run import check

    check(run_config_of(args))
    _resolve(args)
    return args


def _resolve(args: argparse.Namespace) -> None:
    """Write the derived setting once, after every rule passed: ``loss_aggregation`` = the resolved
    mode, and Megatron-LM's ``calculate_per_token_loss`` <=> token_mean (Megatron-LM's own code
    reads it off the namespace; the configs hold the mode once: ``LossConfig.loss_aggregation``)."""
    from rl_plugin.loss_config import LossConfig

    mode = LossConfig.resolved_mode(args)
    args.loss_aggregation = mode
    args.calculate_per_token_loss = mode == "token_mean"


def validate_world(args: argparse.Namespace, *, dp_size: int) -> None:
    """Phase 2: the rules that need the data-parallel size, on the tree of ``args``."""
    from rl_plugin.configs.run import check_world

    check_world(run_config_of(args), dp_size=dp_size)


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line error (a bad value, an unknown flag): ``error: ...`` and
    exit 2, without the ~120 lines of usage argparse prints first."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (all flags: {self.prog} --help)\n")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="rl_plugin: RL post-training on Megatron-Core.", allow_abbrev=False)
    _add_declared(parser, megatron=True)
    return add_rl_arguments(parser)


def with_loss_type_defaults(parser: argparse.ArgumentParser, args, argv) -> argparse.Namespace:
    """The SFT mode (``--loss-type sft_loss``): a conversation is one sample, so
    --n-samples-per-prompt defaults to 1 (an explicit value > 1 is refused by
    ``LossTypeSettings.check``); other runs unchanged."""
    from rl_plugin.configs.mode import Mode

    if Mode.of_flags(args) is not Mode.SFT:
        return args
    parser.set_defaults(n_samples_per_prompt=1)
    return parser.parse_args(argv)


def parse_args(argv: Optional[List[str]] = None, *, validate: bool = True) -> argparse.Namespace:
    parser = build_parser()
    args = with_loss_type_defaults(parser, parser.parse_args(argv), argv)
    return validate_rl_args(args) if validate else args


__all__ = [
    "GROUPS",
    "RLArgumentError",
    "add_rl_arguments",
    "build_parser",
    "parse_args",
    "validate_rl_args",
    "validate_world",
]
