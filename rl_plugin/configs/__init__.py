"""Typed configs below the command line, one module per config: built once from the validated
flags, read everywhere below. A config declares its own flags (``rl_plugin.flags``).

The loop parses and validates the flags (``rl_plugin.arguments``), then builds these once;
backends, train actors and the rollout side receive them and never see the ``Namespace``. Every
value comes from the parser, whose defaults are the only defaults (no second default read off
the namespace below the CLI); a value derived from several flags is computed here, once.

- ``ModelConfig``: what to build: ``--hf-checkpoint``, precision, LM head, attention, TP/CP/PP/SP, seed,
  ``MoEConfig`` (EP, expert-TP, router / aux-loss flags)
- ``OptimizerConfig``: ``--optimizer``, the learning-rate schedule, Adam/SGD settings, ``--clip-grad``
- ``BatchingConfig``: micro-batches (``--micro-batch-size`` or the token budget), step sizes
- ``LossConfig``: the loss core's settings (``rl_plugin.loss_config``, also ``rl_plugin.loss.LossConfig``)
- ``TrainConfig``: one training process: the four above, ``--train-backend``, ``--use-rollout-logprobs``,
  the routing replay mode (``--use-rollout-routing-replay`` / ``--use-routing-replay``,
  ``configs/routing_replay.py``)
- ``EngineConfig``: the generation engine: ``--rollout-engine``, sampling, engine TP, seed, and
  ``ColocationConfig`` (``colocation.py``: ``--colocate``'s memory shares, ``--offload-train``, what
  colocation refuses)
- ``RolloutConfig``: the rollout manager: data, group sizes, evaluation; it carries the fields of
  ``RewardConfig`` (``rewards.py``), ``CustomGenerationConfig`` (``custom_generation.py``) and
  ``DynamicSamplingConfig`` (``dynamic_sampling.py``, with the over-long shaping), which declare them
- ``CriticConfig`` (``critic.py``): PPO's value model (``--advantage-estimator ppo``, slime's critic flags),
  nested as ``run.critic``; ``RunConfig.critic_train`` is the critic group's ``TrainConfig``
- the loop's flags, read by ``rl_plugin.loop.config.LoopConfig``: ``ClusterConfig`` (``cluster.py``),
  ``CheckpointConfig`` (``checkpointing.py``), ``FaultToleranceConfig`` (``fault_tolerance.py``),
  ``LoggingConfig`` (``logging.py``), ``AsyncConfig`` (``async_training.py``), ``CiChecks``
  (``ci_checks.py``: slime's ``--ci-test`` checks); ``TrueOnPolicyConfig`` (``true_on_policy.py``:
  ``--true-on-policy-mode``, ``--deterministic-mode``); the weight sync's are
  ``rl_plugin.weight_sync.SyncSettings``

Each config declares its flags, their rules (``check(run)``, ``check_world(run, dp_size=...)``
on the built instances) and derives what several flags decide (``rl_plugin.flags``);
``Config.from_args(args)`` is generic. They nest into one tree, ``RunConfig`` (``run.py``), built
once with the run's ``Mode`` (``mode.py``, the one place the mode's flags are compared).
Building a ``LossConfig`` loads the user functions named by flags (custom reducer, custom TIS) once,
in the process that builds it (``RunConfig.from_args(args, load_user_code=False)`` defers them:
``RunConfig.with_user_functions``).
"""

from rl_plugin.configs.batching import BatchingConfig
from rl_plugin.configs.engine import EngineConfig
from rl_plugin.configs.model import ModelConfig, MoEConfig
from rl_plugin.configs.optimizer import OptimizerConfig
from rl_plugin.configs.rollout import RolloutConfig
from rl_plugin.configs.train import TrainConfig
from rl_plugin.loss_config import LossConfig

__all__ = [
    "BatchingConfig",
    "EngineConfig",
    "LossConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "TrainConfig",
]
