"""The reward curve (``rl_plugin.loop.plot``): the rewards per rollout read back from the metrics
file (the last row of a re-run rollout wins, eval rewards apart) and the PNG written from them."""

from __future__ import annotations

import json

from rl_plugin.loop.plot import plot_reward_curve, reward_by_rollout


def _metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_last_row_of_a_rollout_wins_and_eval_rewards_are_apart(tmp_path):
    rows = [
        {"step": 1, "rollout_id": 0, "reward_mean": 0.25},
        {"step": 2, "rollout_id": 2, "reward_mean": 0.5},
        {"step": 2, "rollout_id": 2, "eval/reward_mean": 0.125},
        {"step": 3, "rollout_id": 1, "reward_mean": 0.75},  # a rollout re-run after a resume...
        {"step": 3, "rollout_id": 1, "reward_mean": 0.875},  # ...its last row counts
        {"step": 4, "rollout_id": 3, "loss": 0.1},  # no reward: not on the curve
    ]
    train, evals = reward_by_rollout(_metrics(tmp_path / "m.jsonl", rows))
    assert train == {0: 0.25, 1: 0.875, 2: 0.5} and list(train) == [0, 1, 2]  # sorted by rollout
    assert evals == {2: 0.125}


def test_the_png_is_written_into_a_new_directory(tmp_path):
    path = _metrics(tmp_path / "m.jsonl", [{"rollout_id": i, "reward_mean": i / 4} for i in range(5)])
    out = plot_reward_curve(path, tmp_path / "plots" / "curve.png", title="run A")
    assert out == tmp_path / "plots" / "curve.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (700, 400)  # figsize (7, 4) at dpi 100
    empty = plot_reward_curve(_metrics(tmp_path / "e.jsonl", []), tmp_path / "e.png")  # no row yet: an empty plot
    assert empty.read_bytes()[:4] == b"\x89PNG"
