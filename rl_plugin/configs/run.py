"""``RunConfig``: the whole run's typed settings, one tree built once from the parsed flags, with
the run's ``mode`` derived once (``rl_plugin.configs.mode``).

::

    RunConfig
      mode               Mode.SYNC | OVERLAPPED | FULLY_ASYNC | SFT  (configs/mode.py, the one derivation)
      train              TrainConfig: model (moe), batching, loss, optimizer, lora, routing replay
      cluster            ClusterConfig (the world size, once: ``cluster.world_size``)
      rollout            RolloutConfig: engine (colocation), multimodal; carries the fields of the three below
      rewards            RewardConfig
      custom_generation  CustomGenerationConfig
      dynamic_sampling   DynamicSamplingConfig
      sync               SyncSettings (rl_plugin.weight_sync)
      checkpoint         CheckpointConfig
      fault_tolerance    FaultToleranceConfig
      logging            LoggingConfig
      async_training     AsyncConfig
      ci                 CiChecks: slime's in-loop checks (--ci-test)
      critic             CriticConfig: PPO's value model (--advantage-estimator ppo); ``critic_train`` its TrainConfig
      true_on_policy     TrueOnPolicyConfig: --true-on-policy-mode, --deterministic-mode
      embedded           the run takes the embedded task (the loop decides it on the flags as given)

``RunConfig.from_args(args)`` builds it; what the mode decides for a part below the configs is
given to that part as a field once, here (``LossConfig.is_sft``, ``LossConfig.report_worst_token``,
``report_actor_ref`` and ``CiChecks.actor_ref_tolerance``:
the loss core imports no config; ``TrainConfig.true_on_policy`` and ``EngineConfig.true_on_policy``;
``SyncSettings.slots``). ``check(run)`` runs every config's rules (``Declared``: instance methods
``check(run)`` reading their own fields and the others' through the tree, never each other's
writes, so their order is free) after the declared ranges (``flags.check_bounds``);
``check_world(run, dp_size=...)`` the rules that need the data-parallel size.
``rl_plugin.arguments.validate_rl_args`` / ``validate_world`` (the command line's, and Megatron-LM's
``extra_args_provider`` users') build the tree and call these.

Below the command line nothing reads the flags' namespace: the loop builds this tree once and hands
each part its config. The one exception is the user's hooks, whose contract (slime's) is a call
with ``args``: a reward ``rm(args, sample)``, a generate hook ``fn(args, sample, sampling_params)``,
a rollout function ``fn(args, rollout_id, ...)``, a filter ``fn(args, samples)``. The loop hands the
namespace to the rollout manager only for them (``RolloutClient(..., hook_args=args)``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from rl_plugin.configs.async_training import AsyncConfig
from rl_plugin.configs.checkpointing import CheckpointConfig
from rl_plugin.configs.ci_checks import CiChecks, actor_ref_tolerance
from rl_plugin.configs.cluster import ClusterConfig
from rl_plugin.configs.critic import CriticConfig
from rl_plugin.configs.custom_generation import CustomGenerationConfig
from rl_plugin.configs.dynamic_sampling import DynamicSamplingConfig
from rl_plugin.configs.fault_tolerance import FaultToleranceConfig
from rl_plugin.configs.logging import LoggingConfig
from rl_plugin.configs.mode import Mode
from rl_plugin.configs.rewards import RewardConfig
from rl_plugin.configs.rollout import RolloutConfig
from rl_plugin.configs.train import TrainConfig
from rl_plugin.configs.true_on_policy import TrueOnPolicyConfig
from rl_plugin.flags import SPEC, Declared, Nested, check_bounds, derived, from_args, nested, runtime
from rl_plugin.weight_sync import SyncSettings

DEFAULT_OUTPUT_DIR = "outputs/run"


@dataclass(frozen=True)
class RunConfig(Declared):
    mode: Mode = derived(Mode.of_flags, Mode.SYNC)
    train: TrainConfig = nested(TrainConfig)
    cluster: ClusterConfig = nested(ClusterConfig)
    rollout: RolloutConfig = nested(RolloutConfig)
    rewards: RewardConfig = nested(RewardConfig)
    custom_generation: CustomGenerationConfig = nested(CustomGenerationConfig)
    dynamic_sampling: DynamicSamplingConfig = nested(DynamicSamplingConfig)
    sync: SyncSettings = nested(SyncSettings)
    checkpoint: CheckpointConfig = nested(CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = nested(FaultToleranceConfig)
    logging: LoggingConfig = nested(LoggingConfig)
    async_training: AsyncConfig = nested(AsyncConfig)
    ci: CiChecks = nested(CiChecks)
    critic: CriticConfig = nested(CriticConfig)
    true_on_policy: TrueOnPolicyConfig = nested(TrueOnPolicyConfig)
    # the embedded default (rl_plugin.loop.embedded_setup): decided on the flags as given, before the loop
    # fills in its model and data; it picks the output directory's default
    embedded: bool = runtime(False)

    @classmethod
    def from_args(cls, args, *, load_user_code: bool = True, **given) -> "RunConfig":
        """The tree of ``args`` (validated, or to be: ``load_user_code=False`` builds it for the
        rules without loading the user functions the flags name)."""
        run = from_args(cls, args, load_user_code=load_user_code, **given)
        ci = replace(run.ci, actor_ref_tolerance=actor_ref_tolerance(run))
        loss = replace(
            run.train.loss,
            is_sft=run.mode.trains_nll,
            report_worst_token=run.ci.ci_test and run.ci.logprob_abs_diff_threshold is not None,
            report_actor_ref=ci.actor_ref_tolerance is not None,
        )
        on_policy = run.true_on_policy.mode  # --true-on-policy-mode: the backends' and the hf engine's field
        train = replace(run.train, loss=loss, true_on_policy=on_policy)
        mm = run.rollout.multimodal  # a run with images: its pixel bounds reach vLLM's processor
        bounds = (mm.min_pixels, mm.max_pixels) if mm.image_key is not None else None
        engine = replace(run.rollout.engine, true_on_policy=on_policy, pixel_bounds=bounds)
        rollout = replace(run.rollout, engine=engine)
        sync = replace(run.sync, slots=2 if run.mode.generates_ahead else 1)
        return replace(run, train=train, rollout=rollout, sync=sync, ci=ci)

    def with_user_functions(self) -> "RunConfig":
        """This tree with the loss's user functions loaded (a tree built with ``load_user_code=False``
        until the run's preflight checked that they load)."""
        return replace(self, train=replace(self.train, loss=self.train.loss.with_user_functions()))

    def with_model_and_data(self, hf_checkpoint: str, prompt_data: str, eval_prompt_data) -> "RunConfig":
        """This tree with another ``--hf-checkpoint`` / ``--prompt-data`` / ``--eval-prompt-data``
        (the embedded run's, filled in by the loop: ``rl_plugin.loop.embedded_setup``)."""
        model = replace(self.train.model, hf_checkpoint=hf_checkpoint)
        rollout = replace(self.rollout, prompt_data=prompt_data, eval_prompt_data=eval_prompt_data)
        return replace(self, train=replace(self.train, model=model), rollout=rollout)

    @property
    def critic_train(self) -> Optional[TrainConfig]:
        """The critic group's ``TrainConfig`` (``CriticConfig.train_config``: the actor's with
        ``value_head=True``), None when the run trains no critic."""
        return self.critic.train_config(self) if self.critic.enabled else None

    @property
    def output_dir(self) -> Path:
        """``--output-dir``, else ``outputs/embedded_<backend>`` for the embedded task, else
        ``outputs/run`` (the one default)."""
        if self.logging.output_dir:
            return Path(self.logging.output_dir)
        return Path(f"outputs/embedded_{self.train.train_backend}" if self.embedded else DEFAULT_OUTPUT_DIR)

    @property
    def metrics_file(self) -> Path:
        """``--metrics-file``, else ``<output dir>/metrics.jsonl``."""
        return Path(self.logging.metrics_file or self.output_dir / "metrics.jsonl")

    @property
    def planned_dp_size(self) -> int:
        """The data-parallel size the cluster flags imply (training ranks / (TP x CP x PP)); the
        trainer checks the world's actual size again once its actors are up."""
        return max(1, self.cluster.world_size // self.train.model.model_parallel_size)


def config_classes(cls: type = RunConfig) -> List[type]:
    """Every config class in the tree under ``cls`` (itself first, then its nested configs, depth
    first in field order): the classes that declare the run's flags and hold its rules."""
    out: List[type] = []

    def visit(c: type) -> None:
        if c in out:
            return
        out.append(c)
        for f in fields(c):
            spec = f.metadata.get(SPEC)
            if isinstance(spec, Nested):
                visit(spec.cls)

    visit(cls)
    return out


def configs_of(run) -> Iterator[Declared]:
    """Every config instance in the tree ``run`` (one per class, in ``config_classes`` order)."""
    seen = set()

    def visit(c) -> Iterator[Declared]:
        if type(c) in seen:
            return
        seen.add(type(c))
        yield c
        for f in fields(c):
            if isinstance(f.metadata.get(SPEC), Nested):
                yield from visit(getattr(c, f.name))

    yield from visit(run)


def flat_settings(run) -> Dict[str, Any]:
    """Every leaf setting of the tree as ``{"train.model.seed": 1234, ...}`` (a number, string,
    bool or None as it is, anything else as its ``str``): the run's settings for a tracker (W&B)."""
    out: Dict[str, Any] = {}

    def visit(c, prefix: str) -> None:
        for f in fields(c):
            value = getattr(c, f.name)
            if is_dataclass(value) and not isinstance(value, type):
                visit(value, f"{prefix}{f.name}.")
            else:
                simple = value is None or isinstance(value, (bool, int, float, str))
                out[prefix + f.name] = value if simple else str(value)

    visit(run, "")
    return out


def check(run: RunConfig) -> None:
    """Every declared range, then every config's rules (``RLArgumentError`` on the first broken one)."""
    configs = list(configs_of(run))
    for c in configs:
        check_bounds(c)
    for c in configs:
        rule = getattr(c, "check", None)
        if rule is not None:
            rule(run)


def check_world(run: RunConfig, *, dp_size: int) -> None:
    """The rules that need the data-parallel size (known once the world is up, or planned)."""
    for c in configs_of(run):
        rule = getattr(c, "check_world", None)
        if rule is not None:
            rule(run, dp_size=dp_size)
