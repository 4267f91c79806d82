"""The rollout / loop side's configs declare their flags: every field is a flag, a ``same_as``, a
``derived`` value or a ``nested`` config (none is a second default), the parser's default is the
field's, and ``from_args`` (the generic one) reads a command line into the fields the loop reads."""

from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from rl_plugin.arguments import RLArgumentError, build_parser, parse_args
from rl_plugin.configs import EngineConfig, RolloutConfig, TrainConfig
from rl_plugin.configs.mode import Mode
from rl_plugin.configs.rewards import RewardConfig
from rl_plugin.configs.run import RunConfig, config_classes, configs_of
from rl_plugin.flags import RUNTIME, SPEC, Derived, Flag, Nested, SameAs, declared_flags
from rl_plugin.loop.config import LoopConfig
from rl_plugin.weight_sync import SyncSettings

CONFIGS = config_classes(RunConfig)  # every config of the run, from the tree (LoRA and colocation too)
# config -> fields the run config gives once (from its mode, or the loop's decision), not a flag
RUNTIME_ONLY = {
    RunConfig: {"embedded"},
    SyncSettings: {"slots"},
    # value_head: the critic's TrainConfig sets it (RunConfig.critic_train); true_on_policy: the run
    # config sets it from --true-on-policy-mode (issue 45)
    TrainConfig: {"value_head", "true_on_policy"},
    next(c for c in CONFIGS if c.__name__ == "LossConfig"): {"is_sft", "report_worst_token", "report_actor_ref"},
    next(c for c in CONFIGS if c.__name__ == "CiChecks"): {"actor_ref_tolerance"},
    EngineConfig: {"true_on_policy", "pixel_bounds"},  # pixel_bounds: --min/--max-pixels for vLLM (issue 46)
}


def test_the_tree_holds_every_config_that_declares_a_flag():
    names = {c.__name__ for c in CONFIGS}
    assert {"LoraConfig", "ColocationConfig", "AsyncConfig", "SyncSettings", "MoEConfig"} <= names
    flags = [spec.names[0] for c in CONFIGS for _, spec in declared_flags(c)]
    assert len(flags) == len(set(flags)) and len(flags) > 150  # each flag declared once, by one config


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_is_declared_once(cls):
    for f in fields(cls):
        spec = f.metadata.get(SPEC)
        if f.name in RUNTIME_ONLY.get(cls, ()):
            assert spec is RUNTIME, f"{cls.__name__}.{f.name}"
            continue
        assert isinstance(spec, (Flag, SameAs, Derived, Nested)), f"{cls.__name__}.{f.name} has no flag"
        assert f.default is not MISSING or f.default_factory is not MISSING


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_the_parser_default_is_the_field_default(cls):
    defaults = {a.dest: a.default for a in build_parser()._actions}
    for name, spec in declared_flags(cls):
        if isinstance(next(f for f in fields(cls) if f.name == name).metadata[SPEC], Derived):
            assert defaults[spec.dest] == spec.default, spec.names[0]
            continue
        field_default = next(f.default for f in fields(cls) if f.name == name)
        assert defaults[spec.dest] == field_default, spec.names[0]
    assert cls.from_args(build_parser().parse_args([])) == cls()


@pytest.mark.parametrize(
    "argv, mode",
    [
        ([], Mode.SYNC),
        (["--max-weight-staleness", "1"], Mode.OVERLAPPED),
        (["--fully-async", "--max-weight-staleness", "2"], Mode.FULLY_ASYNC),
        (
            ["--loss-type", "sft_loss", "--prompt-data", "c.jsonl", "--rollout-batch-size", "2", "--num-rollout", "1"],
            Mode.SFT,
        ),
    ],
    ids=lambda x: str(x) if isinstance(x, Mode) else " ".join(x) or "defaults",
)
def test_the_mode_is_derived_once_and_given_to_the_parts_that_need_it(argv, mode):
    run = RunConfig.from_args(parse_args(argv))
    assert run.mode is mode
    assert run.train.loss.is_sft is (mode is Mode.SFT)  # the loss core reads a field, not the flag
    assert run.sync.slots == (2 if mode in (Mode.OVERLAPPED, Mode.FULLY_ASYNC) else 1)
    assert mode.generates is (mode is not Mode.SFT) and LoopConfig.of(run).mode is mode
    assert (LoopConfig.of(run).async_settings is run.async_training) is (mode is Mode.FULLY_ASYNC)


def test_loop_config_reads_the_loop_flags():
    args = parse_args(
        [
            *("--prompt-data", "p.jsonl", "--rm-type", "math_exact", "--rollout-batch-size", "4"),
            *("--rollout-max-response-len", "8", "--num-rollout", "5", "--save", "/ck", "--save-interval", "2"),
            *("--max-weight-staleness", "1", "--update-weight-buffer-size", "64", "--check-weight-update-equal"),
            *("--no-progress-bar", "--output-dir", "/o", "--max-rollout-retries", "0", "--log-interval", "3"),
        ]
    )
    cfg = LoopConfig.of(RunConfig.from_args(args))
    assert (cfg.num_rollout, cfg.rollout_batch_size, cfg.save, cfg.save_interval) == (5, 4, "/ck", 2)
    assert cfg.mode is Mode.OVERLAPPED and cfg.sync == SyncSettings(
        buffer_bytes=64, transport="auto", check_weights=True, fingerprint=True, slots=2
    )
    assert not cfg.progress_bar and cfg.max_rollout_retries == 0 and cfg.log_interval == 3
    assert (cfg.output_dir, cfg.metrics_file) == (Path("/o"), Path("/o/metrics.jsonl"))
    assert cfg.save_due(1) and not cfg.save_due(2) and cfg.save_due(4)


def test_one_output_directory_default():
    """--output-dir, else the embedded run's outputs/embedded_<backend>, else outputs/run: one
    place (``RunConfig.output_dir``), and the metrics file follows it."""
    args = parse_args(["--train-backend", "fsdp"])
    assert RunConfig.from_args(args).output_dir == Path("outputs/run")
    embedded = RunConfig.from_args(args, embedded=True)
    assert embedded.output_dir == Path("outputs/embedded_fsdp")
    assert embedded.metrics_file == Path("outputs/embedded_fsdp/metrics.jsonl")
    assert RunConfig.from_args(parse_args(["--output-dir", "/x"]), embedded=True).output_dir == Path("/x")


def test_the_world_size_is_computed_once():
    run = RunConfig.from_args(parse_args(["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2"]))
    assert run.cluster.world_size == 4 and run.planned_dp_size == 2


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
    args = build_parser().parse_args(argv)
    before = dict(vars(args))
    run = RunConfig.from_args(args, load_user_code=False)
    for config in configs_of(run):
        check = getattr(config, "check", None)
        try:
            if check is not None:
                check(run)
        except RLArgumentError:
            pass
        assert vars(args) == before, f"{type(config).__name__}.check wrote args"


def test_rollout_max_context_len_is_one_field():
    """The worked example of adding a flag (issue 32): one ``flag(...)`` field on ``EngineConfig``
    gives the option, its default, its range check and its value in the engine's config."""
    assert EngineConfig.from_args(parse_args(["--rollout-max-context-len", "4096"])).max_context_len == 4096
    assert EngineConfig.from_args(parse_args([])).max_context_len is None
    with pytest.raises(RLArgumentError, match=r"--rollout-max-context-len: must be >= 1 \(got 0\)"):
        parse_args(["--rollout-max-context-len", "0"])
