"""The step's metrics (``rl_plugin.loss.step_metrics``): what one micro-batch records against a hand
computation, the key set each setting reduces, SFT's token-mean NLL and perplexity, and the
aliases (``rollout_log_prob_diff``, DeepSpeed's names)."""

from __future__ import annotations

import math

import torch

from rl_plugin.loss import LossConfig
from rl_plugin.loss.counts import StepCounts
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.step_metrics import (
    LOSS_TERMS,
    MISMATCH_SUMS,
    SUM_METRICS_BASIC,
    TIS_SUMS,
    record_micro_batch,
    step_metric_names,
    union_over_group,
    with_counts_and_aliases,
)
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, within

D = torch.float64
COUNTS = StepCounts(3, 4.0, 2, torch.ones(2), torch.ones(2), torch.ones(3))


def test_one_micro_batch_records_the_sample_mean_sums():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=D)
    old = torch.tensor([-1.5, -2.0, -0.25], dtype=D)
    adv = torch.tensor([0.5, -3.0, 2.0], dtype=D)
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=D)
    w_sm = torch.tensor([0.5, 0.0, 0.25], dtype=D)
    clipped = torch.tensor([1.0, 1.0, 0.0], dtype=D)
    acc = MetricAccumulator()
    one = torch.tensor(1.0, dtype=D)
    record_micro_batch(acc, LossConfig(), one, one, None, None, logp, old, adv, mask, clipped, None, w_sm)
    out = acc.reduce(ParallelState.single())
    r = torch.exp(logp - old)
    assert within(out["ratio_mean"], float((r * w_sm).sum()), rtol=FP64)
    assert within(out["ratio_sum"], math.exp(0.5) + math.exp(-0.25), rtol=FP64)
    assert within(out["ratio_sq_sum"], math.exp(1.0) + math.exp(-0.5), rtol=FP64)
    assert out["pg_clipfrac"] == 0.5 and out["ppo_kl"] == 0.5 * -0.5 + 0.25 * 0.25
    assert out["advantage_mean"] == 0.5 * 0.5 + 0.25 * 2.0 and out["old_log_prob"] == 0.5 * -1.5 + 0.25 * -0.25
    assert out["advantage_max"] == 2.0 and out["advantage_min"] == 0.5  # the masked token's -3 is not trained
    assert out["kl_loss"] == 0.0 and out["entropy_loss"] == 0.0 and out["loss"] == 1.0


def test_the_key_sets_of_each_setting():
    sums, maxes, mins = step_metric_names(LossConfig(), measure_mismatch=False)
    assert sums == [*LOSS_TERMS, *SUM_METRICS_BASIC] and maxes == ["advantage_max"] and mins == ["advantage_min"]
    assert step_metric_names(LossConfig(pg_metrics="none"), False) == (list(LOSS_TERMS), [], [])
    assert step_metric_names(LossConfig(pg_metrics="with_entropy"), False)[0][-1] == "entropy"
    assert step_metric_names(LossConfig(loss_type="sft_loss", is_sft=True), False) == (
        [*LOSS_TERMS, "sft/nll_sum"],
        [],
        [],
    )
    sums, maxes, _ = step_metric_names(LossConfig(use_tis=True), True, ["tis/custom"])
    assert sums[-5:] == [*MISMATCH_SUMS, *TIS_SUMS, "tis/custom"] and maxes[-1] == "mismatch/abs_diff_max"
    assert union_over_group(["b", "a"], None) == ["a", "b"]


def test_sft_reports_the_token_mean_nll_and_its_perplexity():
    out = with_counts_and_aliases({"sft/nll_sum": 6.0}, LossConfig(loss_type="sft_loss", is_sft=True), COUNTS, False)
    assert out == {
        "samples": 3.0,
        "tokens": 4.0,
        "groups": 2.0,
        "sft/tokens": 4.0,
        "sft/nll": 1.5,
        "sft/ppl": math.exp(1.5),
    }
    empty = StepCounts(1, 0.0, 1, torch.ones(1), torch.zeros(1), torch.zeros(1))
    out = with_counts_and_aliases({"sft/nll_sum": 0.0}, LossConfig(loss_type="sft_loss", is_sft=True), empty, False)
    assert out["sft/nll"] == 0.0 and out["sft/ppl"] == 1.0
    huge = with_counts_and_aliases(
        {"sft/nll_sum": 4000.0}, LossConfig(loss_type="sft_loss", is_sft=True), COUNTS, False
    )
    assert huge["sft/ppl"] == math.exp(700.0)  # capped: a finite double


def test_aliases():
    out = with_counts_and_aliases(
        {"mismatch/abs_diff_mean": 0.25, "ratio_mean": 1.5, "advantage_max": 2.0},
        LossConfig(deepspeed_metric_names=True),
        COUNTS,
        True,
    )
    assert out["rollout_log_prob_diff"] == 0.25 and out["ratio_new_old"] == 1.5 and out["max_advantage"] == 2.0
    assert out["num_tokens"] == 4.0 and "entropy" not in out  # an alias only of what was measured
    plain = with_counts_and_aliases({"ratio_mean": 1.5}, LossConfig(), COUNTS, False)
    assert "ratio_new_old" not in plain and "rollout_log_prob_diff" not in plain
