"""The whole rollout as one step batch with advantages, computed ONCE per rollout by the loss
core over whole prompt groups (a rollout always holds whole groups); ``rl_plugin.step_plan``
then cuts it into each rank's optimizer steps."""

from __future__ import annotations

from rl_plugin.loss import StepBatch, compute_advantages, to_tokens
from rl_plugin.rollout.rollout_data import RolloutData


def rollout_batch(data: RolloutData, estimator: str) -> StepBatch:
    """The whole rollout as one StepBatch with advantages (group ids: rollout prompt index) and
    the rollout's loss mask (0 on the tokens a custom generate hook appended: tool output)."""
    loss_mask = data.loss_mask.float()
    adv = compute_advantages(
        estimator, data.rewards, data.group_ids, response_lengths=data.response_lengths, loss_mask=loss_mask
    )
    return StepBatch(
        tokens=data.tokens,
        total_lengths=data.total_lengths,
        response_lengths=data.response_lengths,
        loss_mask=loss_mask,
        advantages=to_tokens(adv.float(), data.response_lengths),
        group_ids=data.group_ids.clone(),
        rollout_log_probs=data.rollout_log_probs,
        routed_experts=data.routed_experts,
    ).validate()
