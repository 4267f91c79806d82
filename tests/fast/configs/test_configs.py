"""The configs package (``rl_plugin.configs``): what it re-exports, the tree it documents (one
module per config; the train config holding the model, batching, loss and optimizer; the rollout
config its engine), and every config frozen. (The whole tree against the parser:
``tests/fast/test_configs.py`` and ``tests/fast/test_declared_configs.py``.)"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

import rl_plugin.configs as configs
from rl_plugin.arguments import parse_args
from rl_plugin.configs.run import RunConfig, config_classes
from rl_plugin.loss_config import LossConfig
from rl_plugin.weight_sync import SyncSettings

# module of rl_plugin/configs -> the config it declares
ONE_MODULE_EACH = {
    "async_training": "AsyncConfig",
    "batching": "BatchingConfig",
    "checkpointing": "CheckpointConfig",
    "ci_checks": "CiChecks",
    "cluster": "ClusterConfig",
    "colocation": "ColocationConfig",
    "critic": "CriticConfig",
    "custom_generation": "CustomGenerationConfig",
    "dynamic_sampling": "DynamicSamplingConfig",
    "engine": "EngineConfig",
    "fault_tolerance": "FaultToleranceConfig",
    "logging": "LoggingConfig",
    "multimodal": "MultimodalConfig",
    "lora": "LoraConfig",
    "optimizer": "OptimizerConfig",
    "rewards": "RewardConfig",
    "rollout": "RolloutConfig",
    "run": "RunConfig",
    "train": "TrainConfig",
    "true_on_policy": "TrueOnPolicyConfig",
}


def test_exports_are_the_configs_of_their_modules():
    assert sorted(configs.__all__) == sorted(
        [
            "BatchingConfig",
            "EngineConfig",
            "LossConfig",
            "ModelConfig",
            "MoEConfig",
            "OptimizerConfig",
            "RolloutConfig",
            "TrainConfig",
        ]
    )
    for name in configs.__all__:
        cls = getattr(configs, name)
        assert cls.__name__ == name
    assert configs.LossConfig is LossConfig  # the loss core's, declared in rl_plugin.loss_config


def test_every_config_of_the_tree_lives_in_its_module():
    """One module per config: every class of the tree but the loss core's and the weight sync's
    (declared beside the code that reads them) comes from rl_plugin/configs, the model module
    holding the model and its MoE part."""
    modules = {cls: cls.__module__ for cls in config_classes(RunConfig)}
    outside = {cls for cls, module in modules.items() if not module.startswith("rl_plugin.configs.")}
    assert outside == {LossConfig, SyncSettings}
    for module, name in ONE_MODULE_EACH.items():
        cls = getattr(importlib.import_module(f"rl_plugin.configs.{module}"), name)
        assert cls in modules and modules[cls] == f"rl_plugin.configs.{module}"
    assert modules[configs.ModelConfig] == modules[configs.MoEConfig] == "rl_plugin.configs.model"
    assert len(modules) == len(ONE_MODULE_EACH) + 2 + 2  # + ModelConfig, MoEConfig, LossConfig, SyncSettings


def test_the_tree_nests_as_documented():
    run = RunConfig.from_args(parse_args([]), load_user_code=False)
    train = run.train
    assert isinstance(train, configs.TrainConfig)
    assert (type(train.model), type(train.batching), type(train.loss), type(train.optimizer)) == (
        configs.ModelConfig,
        configs.BatchingConfig,
        LossConfig,
        configs.OptimizerConfig,
    )
    assert isinstance(train.model.moe, configs.MoEConfig)
    assert isinstance(run.rollout, configs.RolloutConfig) and isinstance(run.rollout.engine, configs.EngineConfig)


@pytest.mark.parametrize("cls", config_classes(RunConfig), ids=lambda c: c.__name__)
def test_every_config_is_frozen(cls):
    """Built once, read everywhere below: no part can change another's settings."""
    instance = cls()
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(instance, field, getattr(instance, field))
