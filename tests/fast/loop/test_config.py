"""The loop's view of the run config (``rl_plugin.loop.config.LoopConfig``): the fields read off
the parsed flags, and the schedule's "is it due after rollout k" rules for the eval, the
checkpoint, the Hugging Face export and the weight sync."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs.mode import Mode
from rl_plugin.loop.config import LoopConfig


def _cfg(*flags, **given):
    return LoopConfig.from_args(parse_train_flags(list(flags)), **given)


def test_fields_are_read_off_the_flags(tmp_path):
    cfg = _cfg("--num-rollout", "6", "--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out"))
    assert cfg.mode is Mode.SYNC and cfg.async_settings is None
    assert (cfg.num_rollout, cfg.rollout_batch_size, cfg.save, cfg.load) == (6, 16, str(tmp_path / "ckpt"), None)
    assert cfg.metrics_file == Path(tmp_path / "out" / "metrics.jsonl") and cfg.run_settings == ()
    assert not cfg.hf_export and cfg.progress_bar
    fully = _cfg("--fully-async", "--max-weight-staleness", "1")
    assert fully.mode is Mode.FULLY_ASYNC and fully.async_settings.max_weight_staleness == 1  # the worker's settings
    assert fully.sync.slots == 2
    assert _cfg("--save-hf", str(tmp_path / "hf")).hf_export
    assert _cfg(run_settings=(("--lr", 1e-6),)).run_settings == (("--lr", 1e-6),)  # set by hand


def test_eval_and_save_are_due_every_interval_and_after_the_last_rollout():
    cfg = _cfg("--num-rollout", "6", "--eval-interval", "4", "--save", "/ckpt", "--save-interval", "4")
    assert [k for k in range(6) if cfg.eval_due(k)] == [3, 5]
    assert [k for k in range(6) if cfg.save_due(k)] == [3, 5]
    no_interval = replace(cfg, save_interval=None, eval_interval=None)
    assert [k for k in range(6) if no_interval.save_due(k)] == [5]  # the last rollout's checkpoint only
    assert not any(no_interval.eval_due(k) for k in range(6))  # no --eval-interval: no eval at all
    assert not any(replace(cfg, save=None).save_due(k) for k in range(6))


def test_the_hf_export_alone_is_due_after_the_last_rollout_without_save():
    cfg = _cfg("--num-rollout", "3", "--save-hf", "/hf")
    assert [k for k in range(3) if cfg.hf_export_due(k)] == [2]
    assert not any(replace(cfg, save="/ckpt").hf_export_due(k) for k in range(3))  # every checkpoint writes it


def test_a_sync_is_due_when_a_later_call_loads_the_weights():
    """Rollout k's weights are loaded by the generate of k + 1 + ahead, or by the eval after k."""
    cfg = _cfg("--num-rollout", "5", "--eval-interval", "2")
    assert [k for k in range(5) if cfg.sync_due(k, ahead=0)] == [0, 1, 2, 3, 4]  # 4: the final eval
    assert [k for k in range(5) if cfg.sync_due(k, ahead=1)] == [0, 1, 2, 3, 4]
    no_eval = replace(cfg, eval_interval=None)
    assert [k for k in range(5) if no_eval.sync_due(k, ahead=0)] == [0, 1, 2, 3]  # nothing loads the last weights
    assert [k for k in range(5) if no_eval.sync_due(k, ahead=1)] == [0, 1, 2]  # rollout 4 was generated on 2's
