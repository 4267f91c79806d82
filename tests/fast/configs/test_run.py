"""The run config (``rl_plugin.configs.run``): the tree built once from the flags, the fields it
derives once (the mode, the loss's ``is_sft``, the sync slots), the one output-directory default,
the metrics file, the planned data-parallel size, and the walks over the tree."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.cluster import ClusterConfig
from rl_plugin.configs.mode import Mode
from rl_plugin.configs.run import (
    DEFAULT_OUTPUT_DIR,
    RunConfig,
    check,
    check_world,
    config_classes,
    configs_of,
    flat_settings,
)
from rl_plugin.configs.train import TrainConfig
from rl_plugin.errors import RLArgumentError


def _run(flags: str = "", **given) -> RunConfig:
    return RunConfig.from_args(parse_args(flags.split()), load_user_code=False, **given)


@pytest.mark.parametrize(
    "flags, mode, is_sft, slots",
    [
        ("", Mode.SYNC, False, 1),
        ("--max-weight-staleness 1", Mode.OVERLAPPED, False, 2),
        ("--fully-async --max-weight-staleness 2", Mode.FULLY_ASYNC, False, 2),
        ("--loss-type sft_loss", Mode.SFT, True, 1),
    ],
)
def test_mode_and_what_it_decides_are_given_once(flags, mode, is_sft, slots):
    run = _run(flags)
    assert run.mode is mode
    assert run.train.loss.is_sft is is_sft
    assert run.sync.slots == slots


def test_output_dir_default_is_outputs_run():
    assert DEFAULT_OUTPUT_DIR == "outputs/run"
    assert _run().output_dir == Path("outputs/run")


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_output_dir_of_the_embedded_task_names_the_backend(backend):
    run = _run(f"--train-backend {backend}", embedded=True)
    assert run.embedded is True
    assert run.output_dir == Path(f"outputs/embedded_{backend}")


def test_output_dir_flag_wins_over_both_defaults():
    assert _run("--output-dir /tmp/x").output_dir == Path("/tmp/x")
    assert _run("--output-dir /tmp/x", embedded=True).output_dir == Path("/tmp/x")


def test_metrics_file_default_is_in_the_output_dir():
    assert _run("--output-dir /tmp/x").metrics_file == Path("/tmp/x/metrics.jsonl")
    assert _run().metrics_file == Path("outputs/run/metrics.jsonl")
    assert _run("--output-dir /tmp/x --metrics-file /tmp/m.jsonl").metrics_file == Path("/tmp/m.jsonl")


@pytest.mark.parametrize(
    "nodes, per_node, tp, dp",
    [(1, 1, 1, 1), (1, 4, 1, 4), (2, 4, 2, 4), (1, 8, 4, 2), (1, 2, 4, 1)],
)
def test_planned_dp_size_is_world_over_model_parallel(nodes, per_node, tp, dp):
    run = _run()
    run = replace(
        run,
        cluster=replace(run.cluster, actor_num_nodes=nodes, actor_num_gpus_per_node=per_node),
        train=replace(run.train, model=replace(run.train.model, tensor_model_parallel_size=tp)),
    )
    assert run.cluster.world_size == nodes * per_node
    assert run.planned_dp_size == dp  # max(1, world // (TP x CP x PP))


def test_world_size_is_read_from_the_flags():
    run = _run("--actor-num-nodes 2 --actor-num-gpus-per-node 3")
    assert run.cluster.world_size == 6 and run.planned_dp_size == 6


def test_with_model_and_data_replaces_the_three_paths_only():
    run = _run("--rollout-batch-size 4")
    filled = run.with_model_and_data("/m", "/d.jsonl", "/e.jsonl")
    assert filled.train.model.hf_checkpoint == "/m"
    assert (filled.rollout.prompt_data, filled.rollout.eval_prompt_data) == ("/d.jsonl", "/e.jsonl")
    assert (
        replace(
            filled,
            train=replace(filled.train, model=replace(filled.train.model, hf_checkpoint=run.train.model.hf_checkpoint)),
            rollout=replace(
                filled.rollout, prompt_data=run.rollout.prompt_data, eval_prompt_data=run.rollout.eval_prompt_data
            ),
        )
        == run
    )


def test_config_classes_start_with_the_run_and_hold_each_class_once():
    classes = config_classes(RunConfig)
    assert classes[0] is RunConfig
    assert TrainConfig in classes and ClusterConfig in classes
    assert len(classes) == len(set(classes))
    # depth first in field order: the train config's nested configs come before the cluster's
    assert classes.index(TrainConfig) < classes.index(ClusterConfig)
    assert config_classes(ClusterConfig) == [ClusterConfig]


def test_configs_of_yields_one_instance_per_class_in_config_classes_order():
    run = _run()
    assert [type(c) for c in configs_of(run)] == config_classes(RunConfig)
    assert next(iter(configs_of(run))) is run


def test_flat_settings_are_dotted_leaves():
    settings = flat_settings(_run("--actor-num-gpus-per-node 2 --output-dir /tmp/o"))
    assert settings["cluster.actor_num_gpus_per_node"] == 2
    assert settings["logging.output_dir"] == "/tmp/o"
    assert settings["mode"] == "sync"  # not a plain value: its str
    assert settings["embedded"] is False
    assert not any(isinstance(v, (dict, list, tuple)) for v in settings.values())


def test_check_runs_the_bounds_then_the_rules():
    run = _run()
    check(run)  # the defaults pass
    with pytest.raises(RLArgumentError, match=r"^--micro-batch-size: must be >= 1 \(got 0\)"):
        check(replace(run, train=replace(run.train, batching=replace(run.train.batching, micro_batch_size=0))))
    with pytest.raises(RLArgumentError, match=r"^--save-interval without --save: "):
        check(replace(run, checkpoint=replace(run.checkpoint, save_interval=2)))


def test_check_world_needs_whole_micro_batches_per_rank():
    run = _run("--global-batch-size 8 --micro-batch-size 2")
    check_world(run, dp_size=2)  # 8 % (2 x 2) == 0
    with pytest.raises(RLArgumentError) as err:
        check_world(run, dp_size=3)
    assert str(err.value).startswith("--global-batch-size 8 with --micro-batch-size 2 on 3 data-parallel ranks")
    assert "a multiple of micro-batch-size x DP = 6" in str(err.value)
