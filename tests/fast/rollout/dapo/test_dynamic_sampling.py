"""DAPO dynamic sampling's rounds (``rl_plugin.rollout.dapo.dynamic_sampling.dynamic_rollout``):
rounds of ``--over-sampling-batch-size`` prompts seeded ``seed + rollout_id + r * stride`` until
``--rollout-batch-size`` groups pass; the first passing groups in generation order are kept, the
counts and one progress line per later round reported, and the run stopped naming the counts after
``--dynamic-sampling-max-rounds``. The filter is a real file loaded as the flag loads it; the
generator makes each prompt's group from its record (so the kept groups can be checked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_plugin.rollout.dapo.dynamic_sampling import dynamic_rollout
from rl_plugin.rollout.dapo.filters import FilterResultError, load_filter
from rl_plugin.rollout.data.dataset import PromptDataset, PromptRecord
from rl_plugin.rollout.flatten import flatten_samples
from rl_plugin.rollout.sample import RolloutData, Sample

N = 2  # samples per prompt


def _cfg(**kw):
    base = dict(
        rollout_batch_size=3,
        n_samples_per_prompt=N,
        over_sampling_batch_size=4,
        dynamic_sampling_max_rounds=5,
        seed=10,
        dynamic_sampling_filter_path="keep.py:keep",
    )
    return SimpleNamespace(**{**base, **kw})


def _filter(tmp_path, body="return samples[0].label % 3 == 0"):
    (tmp_path / "keep.py").write_text(f"def keep(args, samples):\n    {body}\n")
    return load_filter(f"{tmp_path}/keep.py:keep")


class Generator:
    """Record i's group: sample j has tokens [1, 4 + i % 10, 3, 5 + j] (response 1 token), reward
    (i + j) % 2 / 2; it keeps the seeds and records it was called with."""

    def __init__(self):
        self.seeds, self.groups = [], []

    def __call__(self, recs, n, seed):
        self.seeds.append(seed)
        samples = []
        for g, rec in enumerate(recs):
            for j in range(n):
                samples.append(
                    Sample(
                        group_index=g,
                        label=rec.index,
                        tokens=[1, 4 + rec.index % 10, 3, 5 + j],
                        response_length=1,
                        rollout_log_probs=[-0.1 * (rec.index + 1)],
                        reward=float((rec.index + j) % 2) / 2,
                    )
                )
        flat = flatten_samples(samples)
        data = RolloutData(
            tokens=flat.tokens,
            total_lengths=flat.total_lengths,
            response_lengths=flat.response_lengths,
            rollout_log_probs=flat.log_probs,
            rewards=torch.tensor([s.reward for s in samples]),
            group_ids=torch.arange(len(recs)).repeat_interleave(n),
            num_groups=len(recs),
            loss_mask=flat.loss_mask,
            stats={"rollout_gen_time": 1.0, "rollout_reward_time": 0.5, "truncated_frac": 0.25},
            examples=[{"round": len(self.seeds)}],
        )
        self.groups.append([r.index for r in recs])
        return data, samples


def _data(n):
    return PromptDataset([PromptRecord(prompt=f"p{i}", label=i, index=i) for i in range(n)])


def test_rounds_until_enough_groups_pass_keeping_the_first_in_order(tmp_path):
    gen, lines = Generator(), []
    ds = _data(20)
    out = dynamic_rollout(
        _cfg(), 1, ds.next_batch, gen, _filter(tmp_path), round_seed_stride=1000, progress=lines.append
    )
    assert gen.groups == [[0, 1, 2, 3], [4, 5, 6, 7]] and gen.seeds == [11, 1011]
    # passing records: 0, 3 (round 1), 6 (round 2): their groups, renumbered
    kept_tokens = [[1, 4 + i, 3, 5 + j] for i in (0, 3, 6) for j in range(N)]
    assert out.tokens.tolist() == sum(kept_tokens, [])
    assert out.group_ids.tolist() == [0, 0, 1, 1, 2, 2] and out.num_groups == 3
    assert out.rewards.tolist() == [0.0, 0.5, 0.5, 0.0, 0.0, 0.5]
    all_rewards = [float((i + j) % 2) / 2 for i in range(8) for j in range(N)]
    assert out.stats == {
        "reward_mean": 0.25,
        "reward_max": 0.5,
        "response_len_mean": 1.0,
        "truncated_frac": 0.25,
        "rollout_gen_time": 2.0,
        "rollout_reward_time": 1.0,
        "dynamic_sampling/groups_generated": 8.0,
        "dynamic_sampling/groups_passed": 3.0,
        "dynamic_sampling/groups_kept": 3.0,
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/reward_mean_generated": sum(all_rewards) / len(all_rewards),
    }
    assert lines == ["dynamic sampling, rollout 1: round 2/5: 3/8 groups passed the filter so far, kept 3/3"]
    assert out.examples == [{"round": 2}]  # the last round's
    assert ds.state_dict() == {"epoch": 0, "offset": 8}


def test_passing_groups_past_the_batch_size_are_dropped(tmp_path):
    gen, lines = Generator(), []
    out = dynamic_rollout(
        _cfg(rollout_batch_size=1), 0, _data(20).next_batch, gen, _filter(tmp_path), 7, progress=lines.append
    )
    assert gen.groups == [[0, 1, 2, 3]] and lines == []  # one round: no progress line
    assert out.tokens.tolist() == [1, 4, 3, 5, 1, 4, 3, 6]
    assert out.stats["dynamic_sampling/groups_passed"] == 2.0 and out.stats["dynamic_sampling/groups_kept"] == 1.0


def test_without_over_sampling_a_round_is_the_batch_size(tmp_path):
    gen = Generator()
    dynamic_rollout(
        _cfg(over_sampling_batch_size=0), 0, _data(30).next_batch, gen, _filter(tmp_path), 7, lambda _: None
    )
    assert gen.groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_too_few_passing_groups_stop_the_run_naming_the_counts(tmp_path):
    gen, lines = Generator(), []
    with pytest.raises(RuntimeError) as info:
        dynamic_rollout(
            _cfg(dynamic_sampling_max_rounds=2),
            0,
            _data(40).next_batch,
            gen,
            _filter(tmp_path, "return samples[0].label == 5"),
            7,
            progress=lines.append,
        )
    assert str(info.value).startswith(
        "--dynamic-sampling-filter-path keep.py:keep: only 1 of 8 prompt groups passed in 2 rounds "
        "(--dynamic-sampling-max-rounds) of --over-sampling-batch-size 4, short of --rollout-batch-size 3;"
    )
    assert lines == ["dynamic sampling, rollout 0: round 2/2: 1/8 groups passed the filter so far, kept 1/3"]


def test_a_filter_that_returns_no_bool_stops_at_its_first_call(tmp_path):
    gen = Generator()
    with pytest.raises(FilterResultError) as info:
        dynamic_rollout(_cfg(), 0, _data(20).next_batch, gen, _filter(tmp_path, "pass"), 7, lambda _: None)
    assert len(gen.groups) == 1
    assert f"--dynamic-sampling-filter-path {tmp_path}/keep.py:keep (function keep at " in str(info.value)
    assert "returned None of type builtins.NoneType for a group of 2 samples" in str(info.value)
