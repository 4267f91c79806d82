"""The whole rollout as one step batch with advantages, computed ONCE per rollout by the loss
core over whole prompt groups (a rollout always holds whole groups); ``rl_plugin.step_plan``
then cuts it into each rank's optimizer steps. An SFT batch (``sft_batch``) has no advantage and
no sampler log-probs: its per-token loss is the NLL (``--loss-type sft_loss``)."""

from __future__ import annotations

import torch

from rl_plugin.loss import StepBatch, compute_advantages, to_tokens
from rl_plugin.rollout.sample import RolloutData


def rollout_batch(data: RolloutData, estimator: str) -> StepBatch:
    """The whole rollout as one StepBatch with advantages (group ids: rollout prompt index) and
    the rollout's loss mask (0 on the tokens a custom generate hook appended: tool output)."""
    loss_mask = data.loss_mask.float()
    adv = compute_advantages(
        estimator, data.rewards, data.group_ids, response_lengths=data.response_lengths, loss_mask=loss_mask
    )
    return _rollout_step_batch(data, loss_mask, to_tokens(adv.float(), data.response_lengths))


def ppo_base_batch(data: RolloutData) -> StepBatch:
    """The rollout as ``rollout_batch`` lays it out, advantages zero: PPO's come from the critic
    (``loop.ppo_advantages.ppo_batch`` sets them, with the values and returns)."""
    loss_mask = data.loss_mask.float()
    return _rollout_step_batch(data, loss_mask, torch.zeros_like(loss_mask))


def _rollout_step_batch(data: RolloutData, loss_mask: torch.Tensor, advantages: torch.Tensor) -> StepBatch:
    return StepBatch(
        tokens=data.tokens,
        total_lengths=data.total_lengths,
        response_lengths=data.response_lengths,
        loss_mask=loss_mask,
        advantages=advantages,
        group_ids=data.group_ids.clone(),
        rollout_log_probs=data.rollout_log_probs,
        routed_experts=data.routed_experts,
        teacher_log_probs=data.teacher_log_probs,  # --use-opd with an engine-served teacher; else the actors'
        sample_index=torch.arange(data.total_lengths.numel()),  # a report names the rollout's sample
        pixel_values=data.pixel_values,  # images: model inputs only (None for text)
        image_grid_thw=data.image_grid_thw,
        image_counts=data.image_counts,
    ).validate()


def sft_batch(data: RolloutData) -> StepBatch:
    """A batch of SFT conversations (``rl_plugin.rollout.sft_source``) as one StepBatch: the
    assistant-span loss mask, zero advantages (read by no term of the NLL), one group per
    conversation, no rollout log-probs."""
    loss_mask = data.loss_mask.float()
    return StepBatch(
        tokens=data.tokens,
        total_lengths=data.total_lengths,
        response_lengths=data.response_lengths,
        loss_mask=loss_mask,
        advantages=torch.zeros_like(loss_mask),
        group_ids=data.group_ids.clone(),
        pixel_values=data.pixel_values,  # images (rollout.data.vl_sft): model inputs only
        image_grid_thw=data.image_grid_thw,
        image_counts=data.image_counts,
    ).validate()
