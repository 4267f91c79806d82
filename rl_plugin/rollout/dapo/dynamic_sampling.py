"""DAPO dynamic sampling (``--dynamic-sampling-filter-path``): rounds until enough groups pass.

A rollout runs in rounds of ``--over-sampling-batch-size`` prompts (round r seeded ``seed +
rollout_id + r * round_seed_stride``) until ``--rollout-batch-size`` groups have passed the filter
on their raw rewards; the first ``--rollout-batch-size`` passing groups, in generation order, are
the rollout and the rest are dropped (as slime does). At most ``--dynamic-sampling-max-rounds``
rounds (default 64); then the run stops naming the counts and the fix. Every round after the first
reports one progress line (``progress``; the manager prints it): the groups passed of those
generated so far, and the groups kept of those wanted.

The filter (``filters.GroupFilter``) is checked on every group: a result that is not a bool stops
the rollout at its first call (``filters.FilterResultError``), before a second round is generated.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from rl_plugin.configs import RolloutConfig
from rl_plugin.rollout.dapo.filters import GroupFilter
from rl_plugin.rollout.flatten import concat_rollouts, rollout_stats
from rl_plugin.rollout.sample import RolloutData


def dynamic_rollout(
    cfg: RolloutConfig,
    rollout_id: int,
    next_batch: Callable[[int], list],
    generate: Callable,
    group_filter: GroupFilter,
    round_seed_stride: int,
    progress: Callable[[str], None] = print,
) -> RolloutData:
    """Rollout ``rollout_id`` of the groups that pass ``group_filter.keep(cfg, samples_of_group)``.
    ``next_batch(n)``: the next n prompt records; ``generate(recs, n, seed=...)``:
    one round's ``(RolloutData, its scored Samples)``; ``progress(line)``: one line per round
    after the first."""
    want, n = cfg.rollout_batch_size, cfg.n_samples_per_prompt
    per_round = cfg.over_sampling_batch_size or want
    max_rounds = cfg.dynamic_sampling_max_rounds
    kept: List[RolloutData] = []
    generated = passed = 0
    gen_time, reward_time, raw_rewards, truncated = 0.0, 0.0, [], 0.0
    turn_stats: List[dict] = []  # custom generation's per-round multi_turn/* means
    for r in range(max_rounds):
        recs = next_batch(per_round)
        data, samples = generate(recs, n, seed=cfg.seed + rollout_id + r * round_seed_stride)
        gen_time += data.stats["rollout_gen_time"]
        reward_time += data.stats["rollout_reward_time"]
        truncated += data.stats["truncated_frac"] * data.num_groups
        raw_rewards.append(data.rewards)
        turn_stats.append({k: v for k, v in data.stats.items() if k.endswith(("turns_mean", "tool_calls_mean"))})
        keep = [g for g in range(data.num_groups) if group_filter.keep(cfg, samples[g * n : (g + 1) * n])]
        generated += data.num_groups
        passed += len(keep)
        have = sum(k.num_groups for k in kept)
        if keep:
            kept.append(data.select_groups(torch.tensor(keep[: want - have]), n))
        if r > 0:
            progress(
                f"dynamic sampling, rollout {rollout_id}: round {r + 1}/{max_rounds}: {passed}/{generated} groups passed "
                f"the filter so far, kept {min(have + len(keep), want)}/{want}"
            )
        if have + len(keep) >= want:
            break
    else:
        raise RuntimeError(
            f"--dynamic-sampling-filter-path {cfg.dynamic_sampling_filter_path}: only {passed} of {generated} prompt groups "
            f"passed in {max_rounds} rounds (--dynamic-sampling-max-rounds) of --over-sampling-batch-size {per_round}, short of "
            f"--rollout-batch-size {want}; the task is too easy or too hard for the filter (check the rewards). Fix: relax the filter, "
            f"raise --over-sampling-batch-size or --dynamic-sampling-max-rounds, or lower --rollout-batch-size"
        )
    out = concat_rollouts(kept, n)
    out.stats = rollout_stats(out.rewards, out.response_lengths, truncated / generated, gen_time, reward_time)
    out.stats.update(
        {
            "dynamic_sampling/groups_generated": float(generated),
            "dynamic_sampling/groups_passed": float(passed),
            "dynamic_sampling/groups_kept": float(out.num_groups),
            "dynamic_sampling/rounds": float(r + 1),
            "dynamic_sampling/reward_mean_generated": float(torch.cat(raw_rewards).mean()),
        }
    )
    if "multi_turn/model_tokens" in data.stats:  # custom generation: the kept samples' mask, the rounds' means
        kept_tokens = float(out.loss_mask.sum())
        out.stats["multi_turn/model_tokens"] = kept_tokens
        out.stats["multi_turn/masked_token_frac"] = 1.0 - kept_tokens / max(int(out.response_lengths.sum()), 1)
        for key in set.intersection(*(set(t) for t in turn_stats)):
            out.stats[key] = sum(t[key] for t in turn_stats) / len(turn_stats)
    out.examples = data.examples
    return out
