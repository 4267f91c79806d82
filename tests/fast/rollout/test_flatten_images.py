"""A rollout's images: flattened from the samples in StepBatch's layout, kept by group selection and
concatenation, and handed to the step batch."""

from __future__ import annotations

import torch

from rl_plugin.loop.advantages import rollout_batch
from rl_plugin.rollout.flatten import concat_rollouts, flatten_samples
from rl_plugin.rollout.sample import RolloutData, Sample


def _sample(i, grid):
    mm = None
    if grid is not None:
        g = torch.tensor([grid])
        mm = {"pixel_values": torch.full((int(g.prod()), 2), float(i)), "image_grid_thw": g}
    return Sample(index=i, tokens=[1, 2, 3], response_length=1, rollout_log_probs=[-1.0], multimodal_train_inputs=mm)


def _data(samples, rewards):
    flat = flatten_samples(samples)
    return RolloutData(
        tokens=flat.tokens,
        total_lengths=flat.total_lengths,
        response_lengths=flat.response_lengths,
        rollout_log_probs=flat.log_probs,
        rewards=torch.tensor(rewards),
        group_ids=torch.arange(len(samples)) // 2,
        num_groups=len(samples) // 2,
        pixel_values=flat.pixel_values,
        image_grid_thw=flat.image_grid_thw,
        image_counts=flat.image_counts,
    )


def test_flatten_select_concat_and_the_step_batch():
    samples = [_sample(0, [1, 2, 2]), _sample(1, [1, 2, 2]), _sample(2, None), _sample(3, [1, 2, 4])]
    flat = flatten_samples(samples)
    assert flat.image_counts.tolist() == [1, 1, 0, 1] and flat.pixel_values.shape == (16, 2)
    assert flatten_samples(samples[2:3]).pixel_values is None  # text only: no image tensors
    data = _data(samples, [1.0, 0.0, 1.0, 0.0])
    second = data.select_groups(torch.tensor([1]), 2)
    assert second.image_counts.tolist() == [0, 1] and second.pixel_values[:, 0].tolist() == [3.0] * 8
    both = concat_rollouts([second, data.select_groups(torch.tensor([0]), 2)], 2)
    assert both.image_grid_thw.tolist() == [[1, 2, 4], [1, 2, 2], [1, 2, 2]]
    batch = rollout_batch(both, "grpo")
    assert torch.equal(batch.pixel_values, both.pixel_values) and batch.image_counts.tolist() == [0, 1, 1, 1]
