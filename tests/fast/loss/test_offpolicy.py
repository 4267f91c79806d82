"""Off-policy correction and DAPO rollout control, single process: the reference ``tis_weights``
against hand-computed values, identical policies leave the loss bitwise unchanged, every
fail-loud rule of ``LossConfig`` and ``arguments/off_policy.py`` (message names the flags, the rule and the fix),
the group filter and over-long shaping, and dynamic sampling through the real rollout manager
(tiny HF model, real generate). Distributed parity lives in parity/test_loss_layouts.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rl_plugin.arguments import parse_args
from rl_plugin.loss import BadBatchError, LossConfig, StepBatch, prepare_step, tis_weights
from rl_plugin.parallel import ParallelState
from rl_plugin.rollout.dapo.filters import (
    BUILTIN_FILTER,
    check_reward_nonzero_std,
    keep_decision,
    overlong_penalty,
)
from rl_plugin.rollout.sample import Sample
from tests.support.flag_rules import assert_refused
from tests.support.tolerance import FP64, FP64_ELEMENTWISE  # weights <= 2: elementwise exp/clamp, 2 x the bound of 1

# two samples: [d = 0.5, -1.0, 0.2] and [d = 0.1, 0.3] with the last token of sample 0 masked
OLD = torch.tensor([-1.0, -2.0, -0.5, -0.3, -0.7], dtype=torch.float64)
D = torch.tensor([0.5, -1.0, 0.2, 0.1, 0.3], dtype=torch.float64)
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
LENGTHS = [3, 2]


def _w(level, mode, low, high):
    return tis_weights(OLD, OLD - D, MASK, LENGTHS, level=level, mode=mode, clip_low=low, clip_high=high)


def test_tis_weights_token_level_truncate_and_mask():
    w, m = _w("token", "truncate", 0.5, 1.5)
    e = math.exp
    assert w.tolist() == pytest.approx(
        [1.5, 0.5, 1.0, e(0.1), e(0.3)], abs=2 * FP64_ELEMENTWISE
    )  # e^0.5 > 1.5, e^-1 < 0.5
    # masked token: weight exp(0) = 1 (it is weighted 0 by every aggregation), never counted as clipped
    assert m["tis/clipped_frac"] == pytest.approx(0.5 * (2 / 2) + 0.5 * 0.0)  # sample mean of per-token flags
    assert m["tis/weight_mean"] == pytest.approx(0.5 * (1.5 + 0.5) / 2 + 0.5 * (e(0.1) + e(0.3)) / 2)
    w, m = _w("token", "mask", 0.5, 1.5)
    assert w.tolist() == pytest.approx(
        [0.0, 0.0, 1.0, e(0.1), e(0.3)], abs=2 * FP64_ELEMENTWISE
    )  # outside the band: dropped
    assert m["tis/weight_mean"] == pytest.approx(0.5 * 0.0 + 0.5 * (e(0.1) + e(0.3)) / 2)
    assert m["mismatch/abs_diff_mean"] == pytest.approx(0.5 * 1.5 / 2 + 0.5 * 0.4 / 2)
    assert m["mismatch/abs_diff_max"] == pytest.approx(1.0)
    k3 = lambda d: e(d) - 1 - d  # noqa: E731
    assert m["mismatch/k3_kl"] == pytest.approx(0.5 * (k3(0.5) + k3(-1.0)) / 2 + 0.5 * (k3(0.1) + k3(0.3)) / 2)


def test_tis_weights_sequence_and_geometric_levels():
    e = math.exp
    w, _ = _w("sequence", "truncate", 0.0, 10.0)  # exp of the masked SUM of log-ratios
    assert w.tolist() == pytest.approx([e(-0.5)] * 3 + [e(0.4)] * 2, abs=2 * FP64_ELEMENTWISE)
    w, _ = _w("geometric", "truncate", 0.0, 10.0)  # exp of the masked MEAN
    assert w.tolist() == pytest.approx([e(-0.25)] * 3 + [e(0.2)] * 2, abs=2 * FP64_ELEMENTWISE)
    w, m = _w("sequence", "mask", 0.7, 1.3)  # rho_0 = e^-0.5 = 0.61 < 0.7, rho_1 = e^0.4 = 1.49 > 1.3
    assert w.tolist() == [0.0] * 5
    assert m["tis/clipped_frac"] == 1.0
    w, _ = _w("sequence", "mask", 0.5, 1.6)
    assert w.tolist() == pytest.approx([e(-0.5)] * 3 + [e(0.4)] * 2, abs=2 * FP64_ELEMENTWISE)


def _batch(rollout):
    g = torch.Generator().manual_seed(3)
    rl = torch.tensor([3, 1, 4, 2])
    tl = rl + 2
    r = int(rl.sum())
    old = -torch.rand(r, generator=g, dtype=torch.float64) * 2
    return StepBatch(
        tokens=torch.randint(0, 9, (int(tl.sum()),), generator=g),
        total_lengths=tl,
        response_lengths=rl,
        loss_mask=torch.ones(r, dtype=torch.float64),
        advantages=torch.randn(r, generator=g, dtype=torch.float64),
        group_ids=torch.tensor([0, 0, 1, 1]),
        old_log_probs=old,
        rollout_log_probs=rollout(old),
    )


def _run_step(batch, **cfg):
    logp = (batch.old_log_probs + 0.1).clone().requires_grad_(True)
    ctx = prepare_step(batch, LossConfig(**cfg), ParallelState.single(), num_groups=2)
    mb = ctx.micro_batch(torch.arange(batch.num_samples))
    out = ctx.loss(logp[mb.layout.resp_index], None, mb)
    out.objective.backward()
    return out.objective.detach(), logp.grad, ctx.finish()


@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("sequence", "mask"), ("geometric", "truncate")])
def test_identical_policies_weights_exactly_one_and_loss_unchanged(level, mode):
    batch = _batch(lambda old: old.clone())
    j0, g0, r0 = _run_step(batch)
    j1, g1, r1 = _run_step(batch, use_tis=True, tis_level=level, tis_mode=mode, tis_clip_low=0.5, tis_clip=2.0)
    assert torch.equal(j0, j1) and torch.equal(g0, g1)  # bitwise: w = exp(0) = 1 exactly
    assert r1["tis/weight_mean"] == 1.0 and r1["tis/clipped_frac"] == 0.0
    assert r1["mismatch/abs_diff_mean"] == 0.0 and r1["mismatch/k3_kl"] == 0.0 and r1["rollout_log_prob_diff"] == 0.0


def test_tis_changes_the_loss_when_policies_differ_and_needs_rollout_log_probs():
    batch = _batch(lambda old: old - 0.3)
    j0, _, _ = _run_step(batch)
    j1, _, r1 = _run_step(batch, use_tis=True, tis_clip=1.2)
    assert (
        r1["tis/weight_mean"] == pytest.approx(1.2, abs=2 * FP64_ELEMENTWISE) and r1["tis/clipped_frac"] == 1.0
    )  # e^0.3 > 1.2
    assert float(j1) == pytest.approx(1.2 * float(j0), rel=FP64)
    batch.rollout_log_probs = None
    with pytest.raises(
        BadBatchError, match=r"--use-tis needs both old and rollout log-probs; the step batch has no rollout_log_probs"
    ):
        _run_step(batch, use_tis=True)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode,low", [("truncate", 0.0), ("mask", 0.5)])
def test_weights_at_the_log_bound_count_as_clipped(level, mode, low):
    """Issue 28: with an upper bound above e^20 the weights sat at the exp(20) clamp of the
    log-ratio while tis/clipped_frac read 0 (the clamp was not counted)."""
    batch = _batch(lambda old: old - 25.0)  # d = 25 per token: rho = e^25 (e^(25 R_i) per sequence)
    _, _, r = _run_step(batch, use_tis=True, tis_level=level, tis_mode=mode, tis_clip_low=low, tis_clip=1e12)
    assert r["tis/weight_mean"] == pytest.approx(math.exp(20.0), rel=FP64)
    assert r["tis/clipped_frac"] == 1.0  # was 0.0
    w, m = tis_weights(OLD, OLD + 21.0 * MASK, MASK, LENGTHS, level="token", mode=mode, clip_low=0.0, clip_high=1e12)
    assert w.tolist() == pytest.approx(
        [math.exp(-20.0), math.exp(-20.0), 1.0, math.exp(-20.0), math.exp(-20.0)], rel=FP64
    )
    assert m["tis/clipped_frac"] == 1.0  # d = -21 on every unmasked token: the lower side of the bound too
    _, m = _w("token", "truncate", 0.0, 1e12)  # |d| <= 1: nothing at the bound, nothing clipped
    assert m["tis/clipped_frac"] == 0.0


def test_deepspeed_metric_names_alias_ours():
    _, _, r = _run_step(_batch(lambda old: old - 0.1), deepspeed_metric_names=True, pg_metrics="with_entropy")
    for ds, ours in (
        ("ratio_new_old", "ratio_mean"),
        ("kl_new_old", "ppo_kl"),
        ("clipped_ratio_fraction", "pg_clipfrac"),
        ("max_advantage", "advantage_max"),
        ("min_advantage", "advantage_min"),
        ("num_tokens", "tokens"),
        ("old_logprobs", "old_log_prob"),
        ("ratio_new_old_sum", "ratio_sum"),
        ("ratio_new_old_squared_sum", "ratio_sq_sum"),
        ("advantage", "advantage_mean"),
    ):
        assert r[ds] == r[ours], ds
    assert r["num_tokens"] == 10.0


RULES = [
    ("--tis-clip 3", ["--tis-clip without --use-tis", "silently ignored", "add --use-tis"]),
    ("--tis-mode mask --tis-level sequence", ["--tis-level, --tis-mode without --use-tis"]),
    ("--custom-tis-function-path a.b.c", ["--custom-tis-function-path without --use-tis"]),
    (
        "--use-tis --use-rollout-logprobs",
        ["--use-tis with --use-rollout-logprobs", "exactly 1", "drop --use-rollout-logprobs"],
    ),
    ("--use-tis --tis-clip 0", ["--tis-clip: the upper bound must be a finite number > 0 (got 0.0)"]),
    ("--use-tis --tis-clip inf", ["--tis-clip: the upper bound must be a finite number > 0 (got inf)"]),
    ("--use-tis --tis-clip-low -0.1", ["--tis-clip-low: the lower bound must be a finite number >= 0"]),
    (
        "--use-tis --tis-clip-low 2 --tis-clip 1.5",
        ["--tis-clip-low 2.0 with --tis-clip 1.5", "inverted", "--tis-clip-low < --tis-clip"],
    ),
    # issue 28: a truncate band without rho = 1 reweights every token (1e-30: the gradient is gone)
    (
        "--use-tis --tis-clip 1e-30",
        [
            "--tis-mode truncate with the band [0, 1e-30]",
            "excludes rho = 1",
            "shrinks at least 1e+30-fold",
            "--tis-clip 2.0",
        ],
    ),
    (
        "--use-tis --tis-clip-low 1.5 --tis-clip 3",
        ["--tis-mode truncate with the band [1.5, 3]", "excludes rho = 1", "grows at least 1.5-fold"],
    ),
    (
        "--use-tis --tis-mode mask --tis-clip-low 1.1 --tis-clip 2",
        ["--tis-mode mask with the band [1.1, 2.0]", "excludes rho = 1"],
    ),
    (
        "--use-tis --rollout-top-p 0.9",
        ["--use-tis with --rollout-top-p 0.9", "renormalised distribution", "--rollout-top-p 1.0"],
    ),
    (
        "--use-tis --custom-tis-function-path no_such_mod.fn",
        ["--custom-tis-function-path: cannot load the function", "cannot import 'no_such_mod'"],
    ),
    (
        "--over-sampling-batch-size 64",
        ["--over-sampling-batch-size without --dynamic-sampling-filter-path", BUILTIN_FILTER],
    ),
    (
        f"--dynamic-sampling-filter-path {BUILTIN_FILTER} --rollout-batch-size 32 --over-sampling-batch-size 16",
        ["--over-sampling-batch-size 16 with --rollout-batch-size 32", "cannot fill the batch", ">= 32"],
    ),
    # a group of one sample (no reward variance, no group passes) is refused for every estimator by
    # the --n-samples-per-prompt rule of BatchingConfig.check, tested in arguments/test_arguments.py
    (
        "--dynamic-sampling-filter-path rl_plugin.rollout.dapo.filters.nope",
        ["--dynamic-sampling-filter-path: cannot load the function", "no callable 'nope'"],
    ),
    ("--overlong-penalty-factor 1.0", ["--overlong-penalty-factor without --overlong-buffer-len"]),
    ("--overlong-buffer-len 0", ["--overlong-buffer-len: must be >= 1"]),
    (
        "--overlong-buffer-len 8 --overlong-penalty-factor -1",
        ["--overlong-penalty-factor: must be a finite number >= 0"],
    ),
    (
        "--overlong-buffer-len 64 --rollout-max-response-len 64",
        ["--overlong-buffer-len 64 with --rollout-max-response-len 64", "L_max - buffer > 0"],
    ),
    (
        "--deepspeed-grad-scale --loss-aggregation token_mean",
        ["--deepspeed-grad-scale", "normalising by documents", "--loss-aggregation sample_mean"],
    ),
    ("--debug-rollout-logprob-shift nan", ["--debug-rollout-logprob-shift: must be a finite number"]),
    (
        "--debug-rollout-logprob-shift 0.5 --use-rollout-logprobs",
        ["--debug-rollout-logprob-shift with --use-rollout-logprobs"],
    ),
    ("--deepspeed-metric-names --pg-metrics none", ["--deepspeed-metric-names with --pg-metrics none"]),
]


@pytest.mark.parametrize("flags,fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_fails_loud_with_flags_rule_and_fix(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        "--use-tis",
        "--use-tis --tis-level sequence --tis-mode mask --tis-clip-low 0.5 --tis-clip 2",
        "--use-tis --tis-clip 1",  # truncate [0, 1]: rho = 1 keeps its weight 1
        "--use-tis --tis-clip-low 1 --tis-clip 1.5",
        "--use-rollout-logprobs",
        f"--dynamic-sampling-filter-path {BUILTIN_FILTER} --rollout-batch-size 8 --over-sampling-batch-size 16",
        "--overlong-buffer-len 16 --overlong-penalty-factor 0.5 --rollout-max-response-len 64",
        "--deepspeed-grad-scale --deepspeed-metric-names",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_filter_and_overlong_penalty():
    s = lambda r: Sample(prompt="p", response="r", label="l", reward=r, response_length=3)  # noqa: E731
    assert check_reward_nonzero_std(None, [s(1.0), s(0.0)]) and not check_reward_nonzero_std(None, [s(0.5), s(0.5)])
    assert keep_decision(SimpleNamespace(keep=False, reason="zero_std")) is False and keep_decision(True) is True
    # L_max 10, buffer 4: free up to 6, then -f * (len - 6) / 4
    pen = overlong_penalty(torch.tensor([1, 6, 7, 8, 10]), max_len=10, buffer_len=4, factor=0.5)
    assert pen.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_dynamic_sampling_trains_only_groups_with_reward_variance(tmp_path, monkeypatch):
    """Real rollout manager (tiny HF model, real generate, digit-copy rewards): the dynamic rollout
    is exactly the first --rollout-batch-size groups, in order, whose raw rewards vary, of the
    over-sampled round; the counts match; shaping is added after the filter's raw decision."""
    from rl_plugin.configs import RolloutConfig
    from rl_plugin.loop.embedded_setup import prepare_embedded
    from rl_plugin.rollout.manager import RolloutManager
    from rl_plugin.train import parse_train_args

    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path))
    common = ["--n-samples-per-prompt", "4", "--output-dir", str(tmp_path / "out")]
    args = parse_train_args(
        common
        + [
            "--rollout-batch-size",
            "4",
            "--over-sampling-batch-size",
            "12",
            "--dynamic-sampling-filter-path",
            BUILTIN_FILTER,
            "--overlong-buffer-len",
            "2",
        ]
    )
    prepare_embedded(args)
    dyn = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None).generate(0)
    plain_args = parse_train_args(common + ["--rollout-batch-size", "12"])
    prepare_embedded(plain_args)
    plain = RolloutManager(
        RolloutConfig.from_args(plain_args), plain_args.hf_checkpoint, plain_args.prompt_data, None
    ).generate(0)  # = round 0

    raw = plain.rewards.view(12, 4)
    passing = torch.nonzero(raw.std(1) > 0).flatten()
    assert 4 <= passing.numel() < 12, "the fixed seed must give some constant groups (else the test proves nothing)"
    assert dyn.stats["dynamic_sampling/rounds"] == 1.0
    assert dyn.stats["dynamic_sampling/groups_generated"] == 12.0
    assert dyn.stats["dynamic_sampling/groups_passed"] == float(passing.numel())
    assert dyn.stats["dynamic_sampling/groups_kept"] == 4.0 and dyn.num_groups == 4
    want = plain.select_groups(passing[:4], 4)
    for name in ("tokens", "total_lengths", "response_lengths", "rollout_log_probs", "group_ids"):
        assert torch.equal(getattr(dyn, name), getattr(want, name)), name
    penalty = overlong_penalty(dyn.response_lengths, max_len=args.rollout_max_response_len, buffer_len=2, factor=1.0)
    assert torch.equal(dyn.rewards, want.rewards + penalty)
    assert (dyn.rewards - penalty).view(4, 4).std(1).min() > 0  # the filter saw raw rewards
    assert dyn.stats["reward_mean"] == pytest.approx(float(want.rewards.mean()))  # reported reward stays raw
