"""PPO's critic flags (``rl_plugin.configs.critic``, issue 47): slime's spellings and defaults, each
rule refused with its message, what the flags resolve to (the actor's settings by default), and the
critic group's ``TrainConfig`` (``run.critic_train``)."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.critic import CriticConfig
from rl_plugin.configs.mode import Mode
from rl_plugin.configs.run import RunConfig
from rl_plugin.registries import ADVANTAGE_ESTIMATORS
from rl_plugin.registry_base import RegistryError
from tests.support.flag_rules import assert_refused

PPO = "--advantage-estimator ppo"

RULES = [
    (
        "--critic-lr 1e-5 --gamma 0.9",
        [
            "--critic-lr 1e-05, --gamma 0.9 without --advantage-estimator ppo",
            "only --advantage-estimator ppo trains (now --advantage-estimator grpo)",
            "silently ignored",
            "add --advantage-estimator ppo, or drop them",
        ],
    ),
    ("--normalize-advantages", ["--normalize-advantages without --advantage-estimator ppo"]),
    (
        "--critic-num-gpus-per-node 2 --critic-save /tmp/c",
        ["--critic-num-gpus-per-node 2, --critic-save /tmp/c without"],
    ),
    (
        f"{PPO} --fully-async --max-weight-staleness 2",
        [
            "--advantage-estimator ppo with --fully-async",
            "value targets of such a stale group need the values of the critic version",
            "--max-weight-staleness 1 without --fully-async",
        ],
    ),
    (
        f"{PPO} --loss-type sft_loss",
        ["--advantage-estimator ppo with --loss-type sft_loss", "nothing for a critic to estimate"],
    ),
    (f"{PPO} --gamma 1.5", ["--gamma 1.5", "must be in [0, 1]", "use --gamma 1.0"]),
    (f"{PPO} --gamma -0.1", ["--gamma -0.1", "must be in [0, 1]"]),
    (f"{PPO} --lambd 1.01", ["--lambd 1.01", "must be in [0, 1]", "use --lambd 1.0"]),
    (f"{PPO} --value-clip 0", ["--value-clip 0.0", "must be > 0", "never learns", "use --value-clip 0.2"]),
    (f"{PPO} --value-clip -0.2", ["--value-clip -0.2", "must be > 0"]),
    (f"{PPO} --kl-coef -0.01 --use-kl-loss", ["--kl-coef -0.01", "must be >= 0", "use --kl-coef 0"]),
    (
        f"{PPO} --kl-coef 0.05",
        [
            "--kl-coef 0.05 without --use-kl-loss",
            "needs the reference log-probs",
            "only with --use-kl-loss",
            "add --use-kl-loss (with --kl-loss-coef 0 it adds no loss term",
        ],
    ),
    (f"{PPO} --num-critic-only-steps -1", ["--num-critic-only-steps -1", "must be >= 0"]),
    (
        f"{PPO} --num-critic-only-steps 5 --num-rollout 5",
        [
            "--num-critic-only-steps 5 with --num-rollout 5",
            "the actor would never train",
            "below 5",
        ],
    ),
    (
        f"{PPO} --colocate --critic-num-gpus-per-node 2",
        [
            "--colocate with --critic-num-nodes 1 x --critic-num-gpus-per-node 2 and --actor-num-nodes 1 x "
            "--actor-num-gpus-per-node 1",
            "shares the actor's bundles",
            "must be the actor's (1)",
        ],
    ),
    (
        f"{PPO} --actor-num-gpus-per-node 2 --tensor-model-parallel-size 2 --critic-num-gpus-per-node 3",
        ["--critic-num-nodes 1 x --critic-num-gpus-per-node 3 = 3 critic ranks", "multiple of TP x CP x PP = 2"],
    ),
    (
        f"{PPO} --global-batch-size 4 --rollout-batch-size 4 --n-samples-per-prompt 2 --critic-num-gpus-per-node 3",
        [
            "--global-batch-size 4 with --micro-batch-size 1 on the critic's 3 data-parallel ranks",
            "a whole number of micro-batches per step",
            "the critic's DP = 3",
        ],
    ),
    (f"{PPO} --critic-num-nodes 0", ["--critic-num-nodes: must be >= 1 (got 0)"]),
    (f"{PPO} --critic-lr -1", ["--critic-lr: must be >= 0.0 (got -1.0)"]),
    (f"{PPO} --critic-lr-warmup-iters -3", ["--critic-lr-warmup-iters: must be >= 0 (got -3)"]),
    (
        f"{PPO} --save /tmp/run_a --critic-save /tmp/run_a",
        ["--critic-save and --save the same directory (/tmp/run_a)", "overwrite each other", "drop --critic-save"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        PPO,
        f"{PPO} --n-samples-per-prompt 1",  # no group baseline: one sample per prompt is fine (batching's rule)
        f"{PPO} --max-weight-staleness 1",  # one-step-off
        f"{PPO} --lora-rank 8",  # LoRA on the actor, full weights on the critic
        f"{PPO} --use-kl-loss --kl-coef 0.02 --gamma 0 --lambd 0 --value-clip 0.5 --normalize-advantages",
        f"{PPO} --num-critic-only-steps 4 --num-rollout 5",
        f"{PPO} --colocate --critic-num-nodes 1 --critic-num-gpus-per-node 1",
        f"{PPO} --critic-num-nodes 2 --critic-num-gpus-per-node 4 --critic-lr 1e-5 --critic-lr-warmup-iters 3",
        f"{PPO} --global-batch-size 4 --rollout-batch-size 4 --n-samples-per-prompt 2 --critic-num-gpus-per-node 2",
        f"{PPO} --global-batch-size 4 --critic-num-gpus-per-node 3 --use-dynamic-batch-size --max-tokens-per-gpu 64",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_a_group_estimator_still_needs_two_samples_per_prompt():
    assert_refused("--n-samples-per-prompt 1", ["--n-samples-per-prompt 1 with --advantage-estimator grpo"])


def _run(flags: str = "") -> RunConfig:
    return RunConfig.from_args(parse_args(flags.split()))


def test_defaults_are_slimes():
    c = CriticConfig()
    assert not c.enabled
    assert (c.critic_num_nodes, c.critic_num_gpus_per_node, c.critic_load, c.critic_save, c.critic_lr) == (None,) * 5
    assert (c.critic_lr_warmup_iters, c.num_critic_only_steps, c.value_clip, c.gamma, c.lambd) == (0, 0, 0.2, 1.0, 1.0)
    assert (c.normalize_advantages, c.kl_coef) == (False, 0.0)
    assert _run().critic_train is None and _run().critic == c


def test_the_critic_is_no_mode_but_beside_it():
    assert _run(PPO).mode is Mode.SYNC and _run(PPO).critic.enabled
    assert _run(f"{PPO} --max-weight-staleness 1").mode is Mode.OVERLAPPED


def test_resolved_settings_default_to_the_actors():
    run = _run(f"{PPO} --actor-num-nodes 2 --actor-num-gpus-per-node 3 --lr 2e-6 --save /s --load /l")
    c = run.critic
    assert (c.num_nodes(run), c.gpus_per_node(run), c.world_size(run), c.lr(run)) == (2, 3, 6, 2e-6)
    assert (c.save_dir(run), c.load_dir(run)) == ("/s/critic", "/l/critic")
    run = _run(
        f"{PPO} --actor-num-nodes 2 --critic-num-nodes 1 --critic-num-gpus-per-node 4 --critic-lr 1e-5 "
        "--save /s --critic-save /cs --critic-load /cl"
    )
    c = run.critic
    assert (c.num_nodes(run), c.gpus_per_node(run), c.world_size(run), c.lr(run)) == (1, 4, 4, 1e-5)
    assert (c.save_dir(run), c.load_dir(run)) == ("/cs", "/cl")
    run = _run(PPO)
    assert (run.critic.save_dir(run), run.critic.load_dir(run)) == (None, None)  # a fresh head, not saved


def test_critic_train_is_the_actors_with_a_value_head():
    run = _run(
        f"{PPO} --lr 1e-6 --lr-warmup-iters 2 --critic-lr 1e-5 --critic-lr-warmup-iters 7 --lora-rank 4 "
        "--use-kl-loss --kl-loss-coef 0.1 --kl-coef 0.05 --save-hf /hf --eps-clip 0.3 --loss-aggregation token_mean"
    )
    critic, actor = run.critic_train, run.train
    assert critic.value_head and not actor.value_head
    assert (critic.optimizer.lr, critic.optimizer.lr_warmup_iters) == (1e-5, 7)
    assert (actor.optimizer.lr, actor.optimizer.lr_warmup_iters) == (1e-6, 2)
    assert not critic.lora.enabled and actor.lora.enabled  # the critic trains full weights
    assert not critic.loss.use_kl_loss and critic.loss.kl_loss_coef == 0.0  # no reference model
    assert critic.model.save_hf is None and actor.model.save_hf == "/hf"
    # everything else is the actor's: architecture, parallelism, batching, aggregation
    assert critic.model.hf_checkpoint == actor.model.hf_checkpoint and critic.batching == actor.batching
    assert critic.loss.loss_aggregation == "token_mean" and critic.train_backend == actor.train_backend


def test_ppo_is_a_choice_whose_registry_entry_tells_the_loop_to_use_gae():
    assert "ppo" in ADVANTAGE_ESTIMATORS.names()
    with pytest.raises(RegistryError, match=r"--advantage-estimator ppo: PPO's advantages are per token, GAE"):
        ADVANTAGE_ESTIMATORS.get("ppo")(None, None)


def test_ppo_trains_the_ppo_clip_policy_loss():
    assert _run(PPO).train.loss.policy_loss == "ppo_clip"
