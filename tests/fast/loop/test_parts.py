"""Rollout pieces without Ray: rollout -> step planning, weight-sync check, metrics logging and
the reward plot, argument defaults of the embedded run (the checkpoint layout: ``tests/fast/checkpoint``)."""

import json
from types import SimpleNamespace

import pytest
import torch

from rl_plugin.arguments import RLArgumentError
from rl_plugin.errors import WeightSyncError
from rl_plugin.loop.advantages import rollout_batch
from rl_plugin.loop.logger import MetricsLogger, read_metrics
from rl_plugin.loop.plot import plot_reward_curve, reward_by_rollout
from rl_plugin.loss.micro_batch_plan import micro_batches_by_count
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.step_plan import RankPlan, plan_docs_steps, plan_global_batch_steps, split_rollout_for_dp
from rl_plugin.train import parse_train_args
from rl_plugin.weight_sync import compare_fingerprints, weights_fingerprint
from tests.support.tolerance import FP32_LOSS_CORE, tensor_within


def _rollout(num_groups=3, n=4):
    g = torch.Generator().manual_seed(0)
    s = num_groups * n
    rl = torch.randint(1, 5, (s,), generator=g)
    tl = rl + 3
    return RolloutData(
        tokens=torch.randint(0, 16, (int(tl.sum()),), generator=g),
        total_lengths=tl,
        response_lengths=rl,
        rollout_log_probs=-torch.rand(int(rl.sum()), generator=g),
        rewards=torch.rand(s, generator=g),
        group_ids=torch.arange(num_groups).repeat_interleave(n),
        num_groups=num_groups,
    )


def test_rollout_batch_advantages_over_whole_groups():
    data = _rollout()
    b = rollout_batch(data, "grpo")
    per_sample = b.advantages[torch.cumsum(b.response_lengths, 0) - 1]  # last token of each sample
    for gid in range(3):
        r = data.rewards[data.group_ids == gid]
        ref = (r - r.mean()) / (r.std() + 1e-6)
        # fp32 (r - mean) / std in another reduction order: terms of magnitude max|r| / std cancel
        scale = float(r.abs().max() / (r.std() + 1e-6))
        assert tensor_within(per_sample[data.group_ids == gid], ref, rtol=FP32_LOSS_CORE, scale=scale), gid


def test_global_batch_steps_split_over_dp_with_step_local_groups():
    b = rollout_batch(_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    plans = plan_global_batch_steps(b, global_batch_size=6, dp_size=2)  # 2 steps, 3 + 3 per rank
    assert [p.step_bounds for p in plans] == [[(0, 3), (3, 6)], [(0, 3), (3, 6)]]
    assert plans[0].step_num_groups == [2, 2]  # step 0: groups 0,1; step 1: groups 1,2
    # rank 0 holds samples 0-2 and 6-8, rank 1 3-5 and 9-11; group ids renumbered per step
    assert plans[0].batch.group_ids.tolist() == [0, 0, 0, 0, 0, 1] and plans[1].batch.group_ids.tolist() == [
        0,
        1,
        1,
        1,
        1,
        1,
    ]
    assert torch.equal(plans[1].batch.tokens, b.select(torch.tensor([3, 4, 5, 9, 10, 11])).tokens)
    assert sum(p.batch.num_samples for p in plans) == 12


def test_one_dp_rank_plans_the_whole_rollout_without_a_gather():
    """DP = 1: the rank's batch is the rollout's (the steps in order cover it), only the group ids
    renumbered per step; the same tensors the select path gives."""
    b = rollout_batch(_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    (plan,) = plan_global_batch_steps(b, global_batch_size=6, dp_size=1)  # 2 steps: groups 0-1 and 1-2
    ref = b.select(torch.arange(12))
    for name in ("tokens", "total_lengths", "response_lengths", "loss_mask", "advantages", "rollout_log_probs"):
        got, want = getattr(plan.batch, name), getattr(ref, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert plan.batch.group_ids.tolist() == [0] * 4 + [1] * 2 + [0] * 2 + [1] * 4
    assert plan.step_bounds == [(0, 6), (6, 12)] and plan.step_num_groups == [2, 2]
    assert b.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4  # the rollout's batch is left as it was
    (whole,) = plan_global_batch_steps(b, global_batch_size=12, dp_size=1)  # one step: the whole batch
    ((step, num_groups, micro),) = list(whole.steps())
    assert step is not whole.batch and num_groups == 3 and micro is None
    assert all(getattr(step, f) is getattr(whole.batch, f) for f in ("tokens", "advantages", "rollout_log_probs"))
    step.old_log_probs = torch.zeros(int(step.response_lengths.sum()))  # set on the step only
    assert whole.batch.old_log_probs is None


def test_global_batch_must_divide_the_rollout():
    b = rollout_batch(_rollout(num_groups=3, n=4), "grpo")
    with pytest.raises(
        RLArgumentError,
        match=r"--global-batch-size 5: a rollout of --rollout-batch-size x --n-samples-per-prompt = 12 samples",
    ):
        plan_global_batch_steps(b, global_batch_size=5, dp_size=1)


def test_rank_plan_steps_are_slices_of_the_batch_with_their_micro_batches():
    b = rollout_batch(_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    plans = plan_global_batch_steps(b, global_batch_size=6, dp_size=2)
    steps = list(plans[1].steps())
    assert [(s.num_samples, g, m) for s, g, m in steps] == [(3, 2, None), (3, 2, None)]  # micro-batches: the step's own
    assert torch.equal(steps[1][0].tokens, b.select(torch.tensor([9, 10, 11])).tokens)
    plans[1].batch.old_log_probs = torch.zeros(int(plans[1].batch.response_lengths.sum()))  # set after planning...
    assert all(s.old_log_probs is not None for s, _, _ in plans[1].steps())  # ...travels with each step
    with pytest.raises(ValueError, match="RankPlan: 2 step bounds, 1 group counts and no micro-batch lists"):
        RankPlan(b, [(0, 6), (6, 12)], [3])


def test_docs_per_step_plan_on_one_rank():
    """Micro-batches of 2 samples, steps of >= 5 documents: 3 micro-batches per step, the last
    step keeps the short tail; micro-batch indices are relative to the step's start."""
    b = rollout_batch(_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    plan = plan_docs_steps(b, micro_batches_by_count(12, 2), num_groups=3, docs_per_step=5)
    assert plan.step_bounds == [(0, 6), (6, 12)] and plan.step_num_groups == [3, 3]
    assert [[m.tolist() for m in step] for step in plan.step_micro_batches] == [[[0, 1], [2, 3], [4, 5]]] * 2
    plan = plan_docs_steps(b, micro_batches_by_count(12, 3), num_groups=3, docs_per_step=8)
    assert plan.step_bounds == [(0, 9), (9, 12)]
    assert [[m.tolist() for m in step] for step in plan.step_micro_batches] == [
        [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
        [[0, 1, 2]],
    ]


def test_docs_per_step_split_is_contiguous():
    b = rollout_batch(_rollout(num_groups=2, n=3), "grpo")
    parts = split_rollout_for_dp(b, 4)
    assert [p.num_samples for p in parts] == [2, 2, 1, 1]
    assert torch.equal(torch.cat([p.tokens for p in parts]), b.tokens)


def test_weight_sync_check_names_the_tensor():
    sd = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2)}
    fp = weights_fingerprint(sd)
    compare_fingerprints(fp, dict(fp))  # equal: no error
    bad = weights_fingerprint({"a.weight": torch.ones(3), "b.weight": torch.tensor([0.0, 1e-30])})
    with pytest.raises(WeightSyncError, match=r"rollout weights differ from the trainer's at 'b.weight'"):
        compare_fingerprints(fp, bad)
    with pytest.raises(WeightSyncError, match=r"has no tensor 'c'"):
        compare_fingerprints({**fp, "c": "x"}, fp)


def test_metrics_are_appended_never_truncated_and_plotted(tmp_path):
    args = SimpleNamespace(tensorboard_dir=str(tmp_path / "tb"), use_wandb=False, wandb_project="x")
    path = tmp_path / "m" / "metrics.jsonl"
    log = MetricsLogger(args, str(path))
    log.log(1, {"rollout_id": 0, "reward_mean": 0.1, "loss": float("nan")}, {"time/train": 0.5})
    log.close()
    log = MetricsLogger(args, str(path))  # a resumed run
    log.log(2, {"rollout_id": 1, "reward_mean": 0.4})
    log.log(2, {"rollout_id": 1, "eval/reward_mean": 0.3})
    log.close()
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 2] and rows[0]["loss"] == "nan"
    assert json.loads((tmp_path / "m" / "metrics.timings.jsonl").read_text())["time/train"] == 0.5
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert reward_by_rollout(path) == ({0: 0.1, 1: 0.4}, {1: 0.3})
    png = plot_reward_curve(path, tmp_path / "curve.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_embedded_defaults_apply_only_without_prompt_data():
    a = parse_train_args(["--train-backend", "fsdp"])
    assert (a.num_rollout, a.rollout_batch_size, a.lr, a.rm_type) == (300, 16, 3e-3, "digit_match")
    assert parse_train_args(["--lr", "1e-4"]).lr == 1e-4  # an explicit flag wins
    b = parse_train_args(
        [
            "--prompt-data",
            "p.jsonl",
            "--rollout-batch-size",
            "2",
            "--rollout-max-response-len",
            "8",
            "--num-rollout",
            "1",
            "--rm-type",
            "math_exact",
        ]
    )
    assert b.lr == 1e-6 and b.eval_interval is None  # Megatron-LM's defaults, not the embedded ones


def test_train_main_exits_2_on_bad_flags(capsys):
    from rl_plugin.train import main

    assert main(["--colocate", "--rollout-num-gpus", "2"]) == 2
    assert "--colocate with --rollout-num-gpus" in capsys.readouterr().err


def test_fresh_run_keeps_an_earlier_metrics_file(tmp_path):
    from rl_plugin.loop.rows import keep_previous as _keep_previous

    m = tmp_path / "metrics.jsonl"
    _keep_previous(m)  # nothing there: nothing to do
    for text in ("old 1\n", "old 2\n"):
        m.write_text(text)
        (tmp_path / "metrics.timings.jsonl").write_text(text)
        _keep_previous(m)
    assert not m.exists()
    assert (tmp_path / "metrics.jsonl.prev1").read_text() == "old 1\n" and (
        tmp_path / "metrics.jsonl.prev2"
    ).read_text() == "old 2\n"
    assert (tmp_path / "metrics.timings.jsonl.prev2").read_text() == "old 2\n"


def test_rows_carry_the_hook_limit_counters():
    """A hook's samples cut to the limits are counted in the metrics row, not only in a warning
    (``rollout/cut_to_response_len`` was dropped by the row's key filter before)."""
    from rl_plugin.loop.rows import row_stats

    stats = {"reward_mean": 0.5, "reward_max": 1.0, "response_len_mean": 3.0, "truncated_frac": 0.25}
    stats.update({"rollout/cut_to_response_len": 2.0, "rollout/duplicate_groups": 0.0, "rollout_gen_time": 1.5})
    row = row_stats(stats)
    assert row["rollout/cut_to_response_len"] == 2.0 and row["rollout/duplicate_groups"] == 0.0
    assert "rollout_gen_time" not in row  # timings go to metrics.timings.jsonl
