"""The metrics rows (``rl_plugin.loop.rows``): an earlier run's metrics file kept aside, and the
rollout statistics a row carries."""

from __future__ import annotations


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
