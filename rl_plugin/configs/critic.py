"""CriticConfig: PPO with a learned value model (slime's flags; ``--advantage-estimator ppo`` turns
it on), nested in the run config as ``run.critic``.

With a critic, a rollout's advantages are per token: the critic's values V_t of the rollout's
samples (computed before any update: the "old" values), the token-level rewards (the sample's
reward on its last response token, minus ``--kl-coef * (log pi_old - log pi_ref)`` on every
token), then GAE (Schulman et al. 2016; ``rl_plugin.loss.gae``):

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lambd * A_{t+1},   R_t = A_t + V_t

(``--gamma``, ``--lambd``; a loss-masked token is skipped, its terms carried over). The actor
trains on A (whitened over the rollout's trained tokens with ``--normalize-advantages``), the
critic on 0.5 * max((V - R)^2, (clip(V, V_old +- --value-clip) - R)^2) through the run's
``--loss-aggregation``.

The critic is not a mode (``configs/mode.py``): it is orthogonal to the schedule (synchronous or
one-step-off), so the run reads ``run.critic.enabled``. The critic's own training process is
``run.critic_train``: the actor's ``TrainConfig`` with ``value_head=True`` (the actor's architecture
with a scalar head), the critic's learning rate and warm-up, full weights (no LoRA even when the
actor trains adapters), no reference model, no Hugging Face export of the actor's. Its world is
``--critic-num-nodes x --critic-num-gpus-per-node`` (default: the actor's); its checkpoints go to
``--critic-save`` (default ``<--save>/critic``) and come from ``--critic-load`` (default
``<--load>/critic``; none: the ``--hf-checkpoint`` weights with a zero-initialised head).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import List, Optional

from rl_plugin.configs.checkpointing import same_dir
from rl_plugin.configs.lora import LoraConfig
from rl_plugin.configs.mode import Mode
from rl_plugin.errors import fail
from rl_plugin.flags import Bounds, Declared, flag, flag_of, same_as
from rl_plugin.loss_config import LossConfig

GROUP = "critic"
PPO = "ppo"  # --advantage-estimator: the value that trains a critic
CRITIC_DIR = "critic"  # --critic-save / --critic-load default: this subdirectory of --save / --load

# the fields that are the critic's own flags (refused without --advantage-estimator ppo when set)
OWN_FLAGS = (
    "critic_num_nodes",
    "critic_num_gpus_per_node",
    "critic_load",
    "critic_save",
    "critic_lr",
    "critic_lr_warmup_iters",
    "num_critic_only_steps",
    "value_clip",
    "gamma",
    "lambd",
    "normalize_advantages",
    "kl_coef",
)


@dataclass(frozen=True)
class CriticConfig(Declared):
    advantage_estimator: str = same_as(LossConfig, "advantage_estimator")
    critic_num_nodes: Optional[int] = flag(
        "--critic-num-nodes",
        type=int,
        default=None,
        group=GROUP,
        bounds=Bounds(1, "--critic-num-nodes 1"),
        help="Nodes of the critic's training processes (slime). Default: --actor-num-nodes. Disaggregated, the critic "
        "gets bundles of its own beside the actor's and the engines' (the cluster must hold all three); with "
        "--colocate it shares the actor's bundles and must have the actor's size.",
    )
    critic_num_gpus_per_node: Optional[int] = flag(
        "--critic-num-gpus-per-node",
        type=int,
        default=None,
        group=GROUP,
        bounds=Bounds(1, "--critic-num-gpus-per-node 1"),
        help="Critic training processes per node, one GPU each (on a cluster without GPUs: CPU processes) (slime). "
        "Default: --actor-num-gpus-per-node. The critic world (nodes x this) must be a multiple of TP x CP x PP.",
    )
    critic_load: Optional[str] = flag(
        "--critic-load",
        type=str,
        default=None,
        group=GROUP,
        help="Checkpoint directory the critic resumes from (slime), as --load is the actor's. Default: <--load>/critic "
        "when --load is given (where --critic-save puts it by default); without either, the critic starts from the "
        "--hf-checkpoint weights with a scalar value head initialised to zeros.",
    )
    critic_save: Optional[str] = flag(
        "--critic-save",
        type=str,
        default=None,
        group=GROUP,
        help="Checkpoint directory of the critic (slime), saved with the actor's. Default: <--save>/critic.",
    )
    critic_lr: Optional[float] = flag(
        "--critic-lr",
        type=float,
        default=None,
        group=GROUP,
        bounds=Bounds(0.0, "--critic-lr 1e-5"),
        help="Peak learning rate of the critic (slime); its schedule is --lr-decay-style's. Default: --lr. The critic "
        "trains all its weights even when the actor trains LoRA adapters, so it usually wants a larger rate than the "
        "actor (slime's PPO examples: ~10x).",
    )
    critic_lr_warmup_iters: int = flag(
        "--critic-lr-warmup-iters",
        type=int,
        default=0,
        group=GROUP,
        bounds=Bounds(0, "--critic-lr-warmup-iters 0"),
        help="Linear warm-up steps of the critic's learning rate (slime), as --lr-warmup-iters is the actor's.",
    )
    num_critic_only_steps: int = flag(
        "--num-critic-only-steps",
        type=int,
        default=0,
        group=GROUP,
        help="Rollouts at the start of the run on which only the critic trains (slime): the actor stays unchanged "
        "while the fresh value head learns, so the first policy updates do not follow a random baseline. Must be "
        "below --num-rollout.",
    )
    value_clip: float = flag(
        "--value-clip",
        type=float,
        default=0.2,
        group=GROUP,
        help="Value clip range (slime): the critic's loss is 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - "
        "R)^2) (PPO's clipped value loss, as in OpenAI's baselines, verl and slime), V_old the values before the "
        "update, R the GAE returns. Must be > 0.",
    )
    gamma: float = flag(
        "--gamma",
        type=float,
        default=1.0,
        group=GROUP,
        help="Discount of GAE (Schulman et al. 2016) over response tokens: delta_t = r_t + gamma * V_{t+1} - V_t. "
        "In [0, 1]; 1 (slime's default) for an outcome reward on the last token.",
    )
    lambd: float = flag(
        "--lambd",
        type=float,
        default=1.0,
        group=GROUP,
        help="GAE's lambda (slime spells it --lambd): A_t = delta_t + gamma * lambd * A_{t+1}. In [0, 1]: 1 gives "
        "the Monte-Carlo return minus the value (unbiased, noisier), smaller values lean on the critic (less "
        "variance, biased while the critic is wrong).",
    )
    normalize_advantages: bool = flag(
        "--normalize-advantages",
        action="store_true",
        group=GROUP,
        help="Whiten the GAE advantages over the rollout's trained tokens (loss mask 1): A <- (A - mean) / (std + "
        "eps) (slime, verl).",
    )
    kl_coef: float = flag(
        "--kl-coef",
        type=float,
        default=0.0,
        group=GROUP,
        help="Per-token KL penalty folded into the reward before GAE (slime; InstructGPT's reward KL): r_t -= "
        "kl_coef * (log pi_old(t) - log pi_ref(t)). Needs the reference log-probs, which the run computes with "
        "--use-kl-loss (with --kl-loss-coef 0 it adds no loss term). >= 0; 0 disables.",
    )

    @property
    def enabled(self) -> bool:
        """``--advantage-estimator ppo``: the run trains a critic."""
        return self.advantage_estimator == PPO

    def given_flags(self) -> List[str]:
        """``--flag value`` of each of the critic's own flags set away from its default."""
        out = []
        for name in OWN_FLAGS:
            spec, value = flag_of(type(self), name), getattr(self, name)
            if value != spec.default:
                out.append(spec.names[0] if value is True else f"{spec.names[0]} {value}")
        return out

    # -- what the flags resolve to (the actor's settings where the critic's are not given) ----------
    def num_nodes(self, run) -> int:
        return self.critic_num_nodes or run.cluster.actor_num_nodes

    def gpus_per_node(self, run) -> int:
        return self.critic_num_gpus_per_node or run.cluster.actor_num_gpus_per_node

    def world_size(self, run) -> int:
        """The critic's training ranks: nodes x GPUs per node (the actor's by default)."""
        return self.num_nodes(run) * self.gpus_per_node(run)

    def lr(self, run) -> float:
        return run.train.optimizer.lr if self.critic_lr is None else self.critic_lr

    def save_dir(self, run) -> Optional[str]:
        """``--critic-save``, else ``<--save>/critic``, else None (the critic is not saved)."""
        save = run.checkpoint.save
        return self.critic_save or (os.path.join(save, CRITIC_DIR) if save else None)

    def load_dir(self, run) -> Optional[str]:
        """``--critic-load``, else ``<--load>/critic``, else None (a fresh head on ``--hf-checkpoint``)."""
        load = run.checkpoint.load
        return self.critic_load or (os.path.join(load, CRITIC_DIR) if load else None)

    def train_config(self, run):
        """The critic group's ``TrainConfig``: the actor's with ``value_head=True``, the critic's
        learning rate and warm-up, full weights (no LoRA), no reference model or teacher, and none
        of the actor's Hugging Face exports (``--save-hf``, ``--save-hf-merged``)."""
        train = run.train
        optimizer = replace(train.optimizer, lr=self.lr(run), lr_warmup_iters=self.critic_lr_warmup_iters)
        loss = replace(train.loss, use_kl_loss=False, kl_loss_coef=0.0, use_opd=False)
        model = replace(train.model, save_hf=None)
        return replace(train, value_head=True, optimizer=optimizer, loss=loss, model=model, lora=LoraConfig())

    # -- rules ------------------------------------------------------------------------------------
    def check(self, run) -> None:
        if not self.enabled:
            given = self.given_flags()
            if given:
                fail(
                    f"{', '.join(given)} without --advantage-estimator ppo",
                    f"these configure PPO's critic (the value model), which only --advantage-estimator ppo trains "
                    f"(now --advantage-estimator {self.advantage_estimator}): they would be silently ignored",
                    "add --advantage-estimator ppo, or drop them",
                )
            return
        self._check_mode(run)
        self._check_ranges(run)
        self._check_placement(run)
        self._check_dirs(run)

    def _check_mode(self, run) -> None:
        if run.mode is Mode.SFT:
            fail(
                "--advantage-estimator ppo with --loss-type sft_loss",
                "SFT trains the NLL of the data's responses: no reward and no advantage, so there is nothing for a "
                "critic to estimate",
                "drop --advantage-estimator ppo for SFT, or drop --loss-type sft_loss for PPO",
            )
        if run.mode is Mode.FULLY_ASYNC:
            fail(
                "--advantage-estimator ppo with --fully-async",
                "a fully-async group mixes tokens of several weight versions (partial rollouts resume under newer "
                "weights), and GAE's value targets of such a stale group need the values of the critic version that "
                "went with each token's policy, which the critic does not keep (one critic, trained every rollout)",
                "use the one-step-off loop (--max-weight-staleness 1 without --fully-async) or the synchronous one, "
                "or a group estimator (e.g. --advantage-estimator grpo) with --fully-async",
            )

    def _check_ranges(self, run) -> None:
        for name, value in (("--gamma", self.gamma), ("--lambd", self.lambd)):
            if not 0.0 <= value <= 1.0:
                fail(
                    f"{name} {value}",
                    "GAE's discount and lambda must be in [0, 1]: above 1 the advantage sums ever larger future "
                    "terms, below 0 it alternates in sign",
                    f"use {name} 1.0 (slime's default), or a value in [0, 1]",
                )
        if not self.value_clip > 0:
            fail(
                f"--value-clip {self.value_clip}",
                "the clip range of the value loss must be > 0: with c <= 0 the clipped term pins every prediction to "
                "the old value, so the critic never learns",
                "use --value-clip 0.2 (slime's default)",
            )
        if self.kl_coef < 0:
            fail(
                f"--kl-coef {self.kl_coef}",
                "the per-token KL penalty must be >= 0: a negative one rewards moving away from the reference model",
                "use --kl-coef 0 (off) or a small positive value, e.g. 0.01",
            )
        if self.kl_coef > 0 and not run.train.loss.use_kl_loss:
            fail(
                f"--kl-coef {self.kl_coef} without --use-kl-loss",
                "the penalty kl_coef * (log pi_old - log pi_ref) needs the reference log-probs, and the run computes "
                "them (the reference forward pass) only with --use-kl-loss",
                "add --use-kl-loss (with --kl-loss-coef 0 it adds no loss term, only the reference pass), or use "
                "--kl-coef 0",
            )
        steps, rollouts = self.num_critic_only_steps, run.rollout.num_rollout
        if steps < 0:
            fail(
                f"--num-critic-only-steps {steps}",
                "counts rollouts and must be >= 0",
                "use 0 (the actor trains from the first rollout) or a positive count",
            )
        if rollouts is not None and steps >= rollouts:
            fail(
                f"--num-critic-only-steps {steps} with --num-rollout {rollouts}",
                "the actor would never train (every rollout of the run is a critic-only one)",
                f"use --num-critic-only-steps below {rollouts}, or more --num-rollout",
            )

    def _check_placement(self, run) -> None:
        cluster, world = run.cluster, self.world_size(run)
        if cluster.colocate and world != cluster.world_size:
            fail(
                f"--colocate with --critic-num-nodes {self.num_nodes(run)} x --critic-num-gpus-per-node "
                f"{self.gpus_per_node(run)} and --actor-num-nodes {cluster.actor_num_nodes} x "
                f"--actor-num-gpus-per-node {cluster.actor_num_gpus_per_node}",
                "colocated, the critic shares the actor's bundles (one critic rank on each actor rank's), so its "
                f"world must be the actor's ({cluster.world_size})",
                "drop --critic-num-nodes / --critic-num-gpus-per-node (they default to the actor's), or drop --colocate",
            )
        model_parallel = run.train.model.model_parallel_size
        if world % model_parallel != 0:
            fail(
                f"--critic-num-nodes {self.num_nodes(run)} x --critic-num-gpus-per-node {self.gpus_per_node(run)} = "
                f"{world} critic ranks",
                f"the critic has the actor's model parallelism, so its world must be a multiple of TP x CP x PP = "
                f"{model_parallel}",
                f"use a critic world that is a multiple of {model_parallel}",
            )

        batching = run.train.batching
        gbs, mbs, dp = batching.global_batch_size, batching.micro_batch_size, max(1, world // model_parallel)
        if gbs is not None and not batching.use_dynamic_batch_size and gbs % (mbs * dp) != 0:
            fail(
                f"--global-batch-size {gbs} with --micro-batch-size {mbs} on the critic's {dp} data-parallel ranks",
                "the critic trains the actor's steps, so each of its data-parallel ranks must run a whole number of "
                "micro-batches per step too",
                f"make --global-batch-size a multiple of micro-batch-size x the critic's DP = {mbs * dp}, or change "
                "--critic-num-gpus-per-node",
            )

    def _check_dirs(self, run) -> None:
        for name, critic, actor_name, actor in (
            ("--critic-save", self.save_dir(run), "--save", run.checkpoint.save),
            ("--critic-load", self.load_dir(run), "--load", run.checkpoint.load),
        ):
            if same_dir(critic, actor):
                fail(
                    f"{name} and {actor_name} the same directory ({actor})",
                    "the actor's and the critic's checkpoints would overwrite each other (the same iter_* names)",
                    f"drop {name} (default: <{actor_name}>/critic), or give it a directory of its own",
                )
