"""Typed configs below the CLI (``rl_plugin.configs``): built once from the validated flags, their
defaults are the parser's, and nothing below the CLI reads the flags' namespace."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from rl_plugin.arguments import build_parser, parse_args
from rl_plugin.configs import BatchingConfig, EngineConfig, LossConfig, ModelConfig, OptimizerConfig, RolloutConfig
from rl_plugin.configs.run import RunConfig, config_classes
from rl_plugin.flags import SPEC, Derived, Flag

CONFIGS = config_classes(RunConfig)  # every config of the run, from the tree


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_dataclass_defaults_are_the_parsers(cls):
    """A config built from no flags equals the default-constructed one: the parser's defaults and
    the dataclass's cannot drift apart (the parser's: ``validate_rl_args`` writes the resolved
    aggregation mode into the namespace, so the namespace compared is the parse alone)."""
    assert cls.from_args(build_parser().parse_args([])) == cls()


def test_from_args_reads_every_group():
    args = parse_args(
        [
            "--train-backend",
            "fsdp",
            "--hf-checkpoint",
            "/ckpt",
            "--bf16",
            "--fp32-lm-head",
            "--disable-fused-lm-head",
            "--fsdp-attn-implementation",
            "eager",
            "--seed",
            "7",
            "--optimizer",
            "sgd",
            "--lr",
            "0.5",
            "--min-lr",
            "0.1",
            "--lr-decay-style",
            "linear",
            "--lr-decay-iters",
            "9",
            "--lr-warmup-iters",
            "2",
            "--clip-grad",
            "0",
            "--sgd-momentum",
            "0.5",
            "--use-dynamic-batch-size",
            "--max-tokens-per-gpu",
            "64",
            "--micro-batch-size",
            "3",
            "--calculate-per-token-loss",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.1",
            "--use-rollout-logprobs",
        ]
    )
    cfg = RunConfig.from_args(args).train
    assert cfg.train_backend == "fsdp" and cfg.use_rollout_logprobs
    assert cfg.model == ModelConfig(
        hf_checkpoint="/ckpt", bf16=True, fp32_lm_head=True, fused_lm_head=False, attn_implementation="eager", seed=7
    )
    assert cfg.optimizer == OptimizerConfig(
        optimizer="sgd",
        lr=0.5,
        min_lr=0.1,
        lr_decay_style="linear",
        lr_decay_iters=9,
        lr_warmup_iters=2,
        clip_grad=0.0,
        sgd_momentum=0.5,
    )
    assert cfg.batching.max_tokens_per_gpu == 64 and cfg.batching.micro_batch_size == 3
    assert cfg.loss.loss_aggregation == "token_mean" and cfg.loss.use_kl_loss and cfg.loss.kl_loss_coef == 0.1
    # the token budget is the micro-batching rule only under --use-dynamic-batch-size
    assert BatchingConfig.from_args(parse_args(["--max-tokens-per-gpu", "64"])).max_tokens_per_gpu is None


def test_rollout_config_reads_slime_names_and_resolves_defaults():
    args = parse_args(
        [
            "--n-samples-per-eval-prompt",
            "3",
            "--rollout-max-response-len",
            "5",
            "--rollout-num-gpus-per-engine",
            "1",
            "--overlong-buffer-len",
            "2",
            "--rollout-temperature",
            "0.7",
        ]
    )
    cfg = RolloutConfig.from_args(args)
    assert cfg.n_samples_per_eval == 3 and cfg.rollout_max_response_len == cfg.engine.max_response_len == 5
    assert cfg.overlong_penalty_factor == 1.0  # DAPO's default, resolved once here
    assert cfg.engine == EngineConfig(temperature=0.7, max_response_len=5)


# Below the command line: every module but the CLI (arguments/, train.py), the run that builds the
# config tree from the flags (loop/run.py, with the embedded default's paths, loop/embedded_setup.py) and
# the configs' own declarations (configs/, loss_config/, weight_sync/settings.py: a derived value
# is a function of the parsed flags, ``lambda args: ...``).
BELOW_CLI = ["backends", "ray", "rollout", "loss", "checkpoint", "step_plan.py", "weight_sync", "loop"]
ABOVE = {"loop/run.py", "loop/embedded_setup.py", "weight_sync/settings.py"}
ARGS_READ = re.compile(r"getattr\(args\b|\bargs\.[a-z_]|self\.args\b")


def test_nothing_below_the_cli_reads_the_namespace():
    """Backends, the Ray actors and placement, the rollout side, the loss core, checkpoints, the
    weight sync and the loop's parts receive typed configs (``LossConfig``'s declaration, its flags
    and rules, is ``rl_plugin/loss_config/``, below them); the user hooks' namespace travels as
    ``hook_args`` (``rl_plugin.configs.run``)."""
    root = Path(__file__).resolve().parents[2] / "rl_plugin"
    offenders = []
    for part in BELOW_CLI:
        paths = [root / part] if part.endswith(".py") else sorted((root / part).rglob("*.py"))
        for path in paths:
            if str(path.relative_to(root)) in ABOVE:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if ARGS_READ.search(line):
                    offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_declared_once(cls):
    """Each field is a flag (its default the parser's), a same_as / derived / nested field, or
    explicitly runtime-only: no setting has a second default."""
    parser = build_parser()
    defaults = {a.dest: a.default for a in parser._actions}
    for f in fields(cls):
        spec = f.metadata.get(SPEC)
        assert spec is not None, f"{cls.__name__}.{f.name} is neither a flag nor same_as / derived / nested / runtime"
        if isinstance(spec, Flag):
            assert defaults[spec.dest] == f.default, f"{cls.__name__}.{f.name}: the parser's default differs"
        if isinstance(spec, Derived):
            for one in spec.inputs:
                assert defaults[one.dest] == one.default, f"{one.names[0]}: the parser's default differs"


def test_the_loss_config_holds_the_mode_once():
    """--calculate-per-token-loss is the legacy spelling of token_mean: the config holds the mode,
    ``calculate_per_token_loss`` is read off it."""
    cfg = LossConfig.from_args(parse_args(["--calculate-per-token-loss"]))
    assert cfg.loss_aggregation == "token_mean" and cfg.calculate_per_token_loss
    assert not LossConfig(loss_aggregation="prompt_mean").calculate_per_token_loss
    assert LossConfig(loss_aggregation="token_mean").calculate_per_token_loss
