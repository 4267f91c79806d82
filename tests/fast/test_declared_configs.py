"""The rollout / loop side's configs declare their flags: every field is a flag, a ``same_as``, a
``derived`` value or a ``nested`` config (none is a second default), the parser's default is the
field's, and ``from_args`` (the generic one) reads a command line into the fields the loop reads."""

from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from rl_plugin.arguments import RLArgumentError, build_parser, parse_args
from rl_plugin.configs import EngineConfig, RolloutConfig
from rl_plugin.configs.async_training import AsyncConfig
from rl_plugin.configs.checkpointing import CheckpointConfig
from rl_plugin.configs.cluster import ClusterConfig
from rl_plugin.configs.custom_generation import CustomGenerationConfig
from rl_plugin.configs.dynamic_sampling import DynamicSamplingConfig
from rl_plugin.configs.fault_tolerance import FaultToleranceConfig
from rl_plugin.configs.logging import LoggingConfig
from rl_plugin.configs.rewards import RewardConfig
from rl_plugin.flags import SPEC, Derived, Flag, Nested, SameAs, declared_flags
from rl_plugin.loop.config import LoopConfig
from rl_plugin.weight_sync import SyncSettings

CONFIGS = [
    EngineConfig,
    RolloutConfig,
    RewardConfig,
    CustomGenerationConfig,
    DynamicSamplingConfig,
    SyncSettings,
    ClusterConfig,
    CheckpointConfig,
    FaultToleranceConfig,
    LoggingConfig,
    AsyncConfig,
    LoopConfig,
]
RUNTIME_ONLY = {LoopConfig: {"run_settings"}}  # config -> fields set at run time, not from a flag


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_declared_once(cls):
    for f in fields(cls):
        if f.name in RUNTIME_ONLY.get(cls, ()):
            continue
        spec = f.metadata.get(SPEC)
        assert isinstance(spec, (Flag, SameAs, Derived, Nested)), f"{cls.__name__}.{f.name} has no flag"
        assert f.default is not MISSING or f.default_factory is not MISSING


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_the_parser_default_is_the_field_default(cls):
    defaults = {a.dest: a.default for a in build_parser()._actions}
    for name, spec in declared_flags(cls):
        field_default = next(f.default for f in fields(cls) if f.name == name)
        assert defaults[spec.dest] == field_default, spec.names[0]
    assert cls.from_args(parse_args([])) == cls()


def test_loop_config_reads_the_loop_flags():
    args = parse_args(
        [
            *("--prompt-data", "p.jsonl", "--rm-type", "math_exact", "--rollout-batch-size", "4"),
            *("--rollout-max-response-len", "8", "--num-rollout", "5", "--save", "/ck", "--save-interval", "2"),
            *("--max-weight-staleness", "1", "--update-weight-buffer-size", "64", "--check-weight-update-equal"),
            *("--no-progress-bar", "--output-dir", "/o", "--max-rollout-retries", "0", "--log-interval", "3"),
        ]
    )
    cfg = LoopConfig.from_args(args)
    assert (cfg.num_rollout, cfg.rollout_batch_size, cfg.save, cfg.save_interval) == (5, 4, "/ck", 2)
    assert cfg.overlapped and cfg.sync == SyncSettings(
        buffer_bytes=64, transport="auto", check_weights=True, fingerprint=True, slots=2
    )
    assert not cfg.progress_bar and cfg.max_rollout_retries == 0 and cfg.log_interval == 3
    assert (cfg.output_dir, cfg.metrics_file) == (Path("/o"), Path("/o/metrics.jsonl"))
    assert cfg.save_due(1) and not cfg.save_due(2) and cfg.save_due(4)


def test_rollout_config_carries_the_declared_pieces_under_their_flag_names():
    args = parse_args(
        [
            *("--rm-type", "remote_rm", "--rm-url", "http://h:1/r", "--rm-timeout", "5", "--group-rm"),
            *("--custom-rm-path", "m:f"),
        ],
        validate=False,
    )
    cfg = RolloutConfig.from_args(args)
    assert (cfg.rm_type, cfg.rm_url, cfg.rm_timeout, cfg.group_rm) == ("remote_rm", "http://h:1/r", 5.0, True)
    reward = RewardConfig.from_args(args)
    assert all(getattr(cfg, f.name) == getattr(reward, f.name) for f in fields(RewardConfig))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--prompt-data", "p.jsonl"],
        ["--rm-type", "remote_rm", "--rm-timeout", "0"],
        ["--overlong-penalty-factor", "2", "--over-sampling-batch-size", "4"],
        ["--max-weight-staleness", "1", "--colocate", "--update-weight-transport", "nccl"],
        ["--save-interval", "3", "--overwrite-save", "--save-retain", "0", "--ckpt-step", "-1"],
    ],
    ids=lambda a: " ".join(a) or "defaults",
)
def test_a_rule_never_writes_args(argv):
    from rl_plugin.errors import RLArgumentError

    args = build_parser().parse_args(argv)
    before = dict(vars(args))
    for cls in CONFIGS:
        check = getattr(cls, "check", None)
        try:
            if check is not None:
                check(args)
        except RLArgumentError:
            pass
        assert vars(args) == before, f"{cls.__name__}.check wrote args"


def test_rollout_max_context_len_is_one_field():
    """The worked example of adding a flag (issue 32): one ``flag(...)`` field on ``EngineConfig``
    gives the option, its default, its range check and its value in the engine's config."""
    assert EngineConfig.from_args(parse_args(["--rollout-max-context-len", "4096"])).max_context_len == 4096
    assert EngineConfig.from_args(parse_args([])).max_context_len is None
    with pytest.raises(RLArgumentError, match=r"--rollout-max-context-len: must be >= 1 \(got 0\)"):
        parse_args(["--rollout-max-context-len", "0"])
