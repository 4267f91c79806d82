"""slime's --ci-test on the embedded default end to end (Megatron, the hf engine, real Ray actors):
the trainer's and the engine's log-probs differ on this CPU (another kernel path: ~1.5e-6 at most
on the embedded model), so a threshold of 0 (bitwise) stops the run at rollout 0 with one line
naming the check, the rollout, the worst token and both values (exit 1; the rows of that rollout
are written first and name the same token), and a generous threshold runs to the end with every
weight sync's fingerprints compared (``--ci-test`` turns them on)."""

import json
import re

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402

T = "--ci-train-rollout-logprob-abs-diff-threshold"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield


def _run(out, threshold):
    argv = ["--train-backend", "megatron", "--output-dir", str(out), "--num-rollout", "2", "--no-progress-bar"]
    return main([*argv, "--ci-test", T, threshold])


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_threshold_0_stops_at_rollout_0_naming_the_worst_token(ray_cluster, tmp_path, capsys):
    assert _run(tmp_path, "0") == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if "ci-test:" in x]
    assert len(lines) == 1, lines
    (row,) = [r for r in _rows(tmp_path) if "mismatch/worst_sample" in r]  # rollout 0's one step, then the stop
    assert row["rollout_id"] == 0 and row["mismatch/abs_diff_max"] > 0
    old, rollout = row["mismatch/worst_old_log_prob"], row["mismatch/worst_rollout_log_prob"]
    want = (
        f"error: ci-test: {T} 0: rollout 0, sample {int(row['mismatch/worst_sample'])} token "
        f"{int(row['mismatch/worst_position'])}: trainer log-prob {old:.6f} vs rollout log-prob {rollout:.6f} "
        f"(|diff| {abs(old - rollout):.2g})"
    )
    assert lines[0] == want
    assert re.fullmatch(r".*\(\|diff\| [0-9.e-]+\)", lines[0])


def test_a_generous_threshold_runs_every_rollout(ray_cluster, tmp_path, capsys):
    assert _run(tmp_path, "1.0") == 0
    rows = [r for r in _rows(tmp_path) if "mismatch/worst_sample" in r]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert all(0 < r["mismatch/abs_diff_max"] <= 1.0 for r in rows)
    assert "ci-test:" not in capsys.readouterr().err
