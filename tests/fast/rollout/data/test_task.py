"""The embedded digit task (``rl_plugin.rollout.data.task``): its records, its partial-credit reward
and the train / eval files it writes (disjoint prompts)."""

import json

import pytest

from rl_plugin.rollout.data.task import digit_match_reward, make_task_records, write_task_data


def test_task_records_and_reward(tmp_path):
    recs = make_task_records(3, task="reverse", seed=1)
    assert all(r["label"] == r["prompt"][:-1][::-1] for r in recs)
    assert digit_match_reward("413", "413") == 1.0
    assert digit_match_reward("41", "413") == pytest.approx(2 / 3)
    assert digit_match_reward("4139", "413") == pytest.approx(3 / 4)  # extra characters cost credit
    assert digit_match_reward("", "413") == 0.0
    train, ev = write_task_data(tmp_path, num_train=50, num_eval=8, seed=0)
    tr = {json.loads(x)["prompt"] for x in train.read_text().splitlines()}
    evp = {json.loads(x)["prompt"] for x in ev.read_text().splitlines()}
    assert len(evp) == 8 and not tr & evp
