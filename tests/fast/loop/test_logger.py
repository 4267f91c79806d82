"""The metrics log (``rl_plugin.loop.logger``): rows appended to ``metrics.jsonl`` (never truncated on a
resume), timings beside them, TensorBoard events, and the reward curve read back from the file."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rl_plugin.loop.logger import MetricsLogger, read_metrics
from rl_plugin.loop.plot import plot_reward_curve, reward_by_rollout


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


def test_summary_line_names_the_critic_when_there_is_one():
    from rl_plugin.loop.logger import summary_line

    row = {"rollout_id": 2, "reward_mean": 0.25, "critic/value_loss": 0.01234, "critic/explained_variance": 0.4567}
    assert summary_line(3, row, {}) == "step 3 | rollout 2 | reward 0.250 | value_loss 0.01234 | expl_var 0.457"
    assert "value_loss" not in summary_line(3, {"rollout_id": 2, "reward_mean": 0.25}, {})
