"""Which per-token loss the step trains on (slime's ``--loss-type``).

- ``policy_loss`` (default): the policy-gradient loss of ``--advantage-estimator`` on sampled
  responses (``rl_plugin.loss.policy``).
- ``sft_loss``: supervised fine-tuning. The per-token loss is the negative log-likelihood of the
  target token, l_t = -log p_theta(y_t | y_<t), on the tokens whose loss mask is 1 (the assistant
  turns of a templated conversation, ``rl_plugin.rollout.data.sft``), aggregated by the SAME core
  (``--loss-aggregation``, ``--calculate-per-token-loss``, global counts over DP x micro-batches)
  as the policy loss. No rollout engine starts, no old / reference log-prob pass runs and no
  advantage is computed (``rl_plugin.loop.sft_schedule``).

The rules below refuse the flags that have no meaning without sampled rollouts, so a setting is
never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_plugin.errors import fail
from rl_plugin.flags import flag, runtime

GROUP = "sft and distillation"
LOSS_TYPES = ("policy_loss", "sft_loss")


@dataclass(frozen=True)
class LossTypeSettings:
    loss_type: str = flag(
        "--loss-type",
        choices=LOSS_TYPES,
        default="policy_loss",
        help=(
            "policy_loss: reinforcement learning on sampled responses (the default). sft_loss: supervised fine-tuning "
            "on the conversations of --prompt-data (chat 'messages', or --input-key / --label-key prompt + completion "
            "pairs): the per-token loss is the NLL of the assistant tokens, aggregated by --loss-aggregation like the "
            "policy loss; no rollout engine starts. Use it as the cold start before RL (its --save-hf output or "
            "checkpoint starts the RL run). slime's --loss-type."
        ),
        group=GROUP,
    )

    # the run's mode trains the NLL (``Mode.SFT``): given once by the run config from its mode
    # (``rl_plugin.configs.run``), so the loss core reads a field and derives nothing
    is_sft: bool = runtime(False)

    def check(self, run) -> None:
        if not self.is_sft:
            return
        refused = [
            ("--use-tis", self.use_tis, "there is no sampling engine whose log-probs could differ from the trainer's"),
            ("--use-kl-loss", self.use_kl_loss, "SFT runs no reference model; the NLL is the whole objective"),
            (
                "--use-rollout-logprobs",
                run.train.use_rollout_logprobs,
                "SFT samples nothing, so there are no engine log-probs",
            ),
            (
                "--custom-generate-function-path",
                run.custom_generation.custom_generate_function_path,
                "SFT trains on the data's own conversations; nothing is generated",
            ),
            (
                "--rollout-function-path",
                run.custom_generation.rollout_function_path,
                "SFT trains on the data's conversations",
            ),
            (
                "--dynamic-sampling-filter-path",
                run.dynamic_sampling.dynamic_sampling_filter_path,
                "SFT samples no groups to filter",
            ),
            (
                f"--max-weight-staleness {run.async_training.max_weight_staleness}",
                run.async_training.generates_ahead,
                "SFT generates nothing that could overlap training (the overlapped and async loops are RL's)",
            ),
            (
                f"--n-samples-per-prompt {run.train.batching.n_samples_per_prompt}",
                run.train.batching.n_samples_per_prompt > 1,
                "every conversation would be trained on that many times per step (a conversation is one sample)",
            ),
            ("--use-opd", self.use_opd, "distillation needs the student's own samples"),
            ("--custom-rm-path", run.rewards.custom_rm_path, "SFT trains on the data's answers; nothing is scored"),
        ]
        for name, on, why in refused:
            if on:
                fail(
                    f"--loss-type sft_loss with {name}",
                    why,
                    f"drop {name.split()[0]}, or use --loss-type policy_loss",
                )
        if self.temperature != 1.0:
            fail(
                f"--loss-type sft_loss with --rollout-temperature {self.temperature}",
                "the NLL is of the model's own distribution (temperature 1); another temperature trains a rescaled one",
                "drop --rollout-temperature",
            )
        if self.entropy_coef != 0.0:
            fail(
                "--loss-type sft_loss with --entropy-coef",
                "an entropy bonus fights the NLL it is added to (it pushes the model away from the targets)",
                "drop --entropy-coef",
            )
