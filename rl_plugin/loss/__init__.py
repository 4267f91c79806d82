"""The shared loss core: pure functions of tensors, global counts and a ParallelState.

Never imports a backend, Ray, or megatron's parallel_state. See ``runner.py`` for the step runner
both backends plug into (and the device contract), ``backend_api.py`` for the types a backend
sees, and ``step.py`` for the per-step loss protocol. This package is the core's public
interface: a backend imports the core only from here (``tests/fast/test_layers.py``).
"""

from rl_plugin.loss.advantages import compute_advantages, gae, to_tokens
from rl_plugin.loss.aggregation import AGGREGATION_MODES, aggregate, load_custom_reducer, token_weights
from rl_plugin.loss.backend_api import ForwardFn, ForwardOptions, LossFn, MicroBatch, MicroBatchInputs, StepBackend
from rl_plugin.loss.batch import StepBatch, select_images
from rl_plugin.loss.counts import StepCounts, compute_step_counts
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.loss.fused_head import default_chunk_rows, fused_log_probs_and_entropy
from rl_plugin.loss.invariant_head import invariant_log_probs_and_entropy
from rl_plugin.loss.kl import kl_estimate
from rl_plugin.loss.logprobs import TargetOutOfVocabError, fp32_output_projection, log_probs_and_entropy
from rl_plugin.loss.micro_batch_plan import plan_micro_batches, plan_steps_by_docs, split_samples_for_dp
from rl_plugin.loss.objective import MicroBatchLoss
from rl_plugin.loss.offpolicy import TIS_LEVELS, TIS_MODES, load_custom_tis_function, tis_weights
from rl_plugin.loss.policy import get_policy_loss, gspo_loss, ppo_clip_loss, register_policy_loss
from rl_plugin.loss.runner import StepRunner, old_log_probs_rule
from rl_plugin.loss.step import StepContext, prepare_step
from rl_plugin.loss.value import value_loss
from rl_plugin.loss.value_step import DEFAULT_VALUE_CLIP, ValueStepContext, prepare_value_step
from rl_plugin.loss.worst_token import ACTOR_REF_KEYS
from rl_plugin.loss_config import LossConfig

__all__ = [
    "ACTOR_REF_KEYS",
    "AGGREGATION_MODES",
    "DEFAULT_VALUE_CLIP",
    "BadBatchError",
    "ForwardFn",
    "ForwardOptions",
    "LossConfig",
    "LossFn",
    "MicroBatch",
    "MicroBatchInputs",
    "MicroBatchLoss",
    "StepBackend",
    "StepBatch",
    "select_images",
    "StepContext",
    "StepCounts",
    "StepRunner",
    "TargetOutOfVocabError",
    "aggregate",
    "compute_advantages",
    "compute_step_counts",
    "default_chunk_rows",
    "fp32_output_projection",
    "fused_log_probs_and_entropy",
    "gae",
    "get_policy_loss",
    "invariant_log_probs_and_entropy",
    "gspo_loss",
    "kl_estimate",
    "load_custom_reducer",
    "log_probs_and_entropy",
    "old_log_probs_rule",
    "plan_micro_batches",
    "plan_steps_by_docs",
    "ppo_clip_loss",
    "prepare_step",
    "prepare_value_step",
    "register_policy_loss",
    "split_samples_for_dp",
    "to_tokens",
    "value_loss",
    "ValueStepContext",
    "token_weights",
    "TIS_LEVELS",
    "TIS_MODES",
    "load_custom_tis_function",
    "tis_weights",
]
