"""The loop's output per rollout: one metrics row per optimizer step, the progress bar, the
summary line every ``--log-interval`` steps.

A row is ``{rollout_id, step_in_rollout, <rollout stats>, <the step's report>}`` in
``metrics.jsonl``; the step's ``time/*`` entries (and, on the rollout's first step, the
rollout's own timings) go to ``metrics.timings.jsonl`` so the metrics file of a run is the same
bytes whatever the machine's speed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from rl_plugin.configs.run import RunConfig, flat_settings
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.logger import MetricsLogger, summary_line
from rl_plugin.loop.resume import Progress
from rl_plugin.rollout.sample import RolloutData

ROLLOUT_STATS = ("reward_mean", "reward_max", "response_len_mean", "truncated_frac")
# ``rollout/``: a hook's samples held to the limits and repeated groups (``rollout.sample_check``)
# ``async/``: the fully-async take's staleness, buffer and wait (``rollout.fully_async``)
ROLLOUT_STAT_PREFIXES = (
    "dynamic_sampling/",
    "overlong/",
    "reward_shaped_mean",
    "multi_turn/",
    "rollout/",
    "agent/",
    "async/",
)


def row_stats(stats: Dict[str, Any]) -> Dict[str, Any]:
    """The rollout's stats a metrics row carries: ``ROLLOUT_STATS`` and every key under
    ``ROLLOUT_STAT_PREFIXES`` (the rollout's timings go to the timings file instead)."""
    out = {key: stats[key] for key in ROLLOUT_STATS if key in stats}  # an SFT batch has no reward
    out.update({key: v for key, v in stats.items() if key.startswith(ROLLOUT_STAT_PREFIXES)})
    return out


def keep_previous(metrics_file: Path) -> None:
    """A fresh (not resumed) run starts a new metrics file; an earlier run's files are renamed
    to ``*.prev<N>``, never deleted. A resumed run appends instead."""
    for path in (metrics_file, metrics_file.with_name(metrics_file.stem + ".timings.jsonl")):
        if path.exists() and path.stat().st_size > 0:
            n = 1
            while path.with_name(f"{path.name}.prev{n}").exists():
                n += 1
            path.rename(path.with_name(f"{path.name}.prev{n}"))
            print(f"{path} exists from an earlier run: kept as {path.name}.prev{n}", flush=True)


class RowLogger:
    def __init__(self, run: RunConfig, cfg: LoopConfig, start_rollout: int):
        from tqdm import tqdm

        self.cfg = cfg
        self.metrics = MetricsLogger(run.logging, str(cfg.metrics_file), flat_settings(run))
        self.bar = tqdm(
            total=cfg.num_rollout,
            initial=start_rollout,
            disable=not cfg.progress_bar,
            desc="rollouts",
            dynamic_ncols=True,
        )

    def log_steps(
        self,
        progress: Progress,
        k: int,
        data: RolloutData,
        reports: List[Dict[str, Any]],
        timings: Dict[str, float],
        t0: float,
        staleness: Optional[int],
    ) -> None:
        """One row per step report of rollout k; advances ``progress`` (step, samples seen)."""
        stats = row_stats(data.stats)
        if staleness is not None:  # overlapped runs only: the synchronous loop's metrics stay as they were
            stats["weight_staleness"] = float(staleness)
        t_engine, t_reward = (
            data.stats.get("rollout_gen_time", timings.get("time/rollout_call", 0.0)),
            data.stats.get("rollout_reward_time", 0.0),
        )
        for j, rep in enumerate(reports):
            progress.step += 1
            progress.samples_seen += int(rep["samples"])
            rep["samples_seen"] = float(progress.samples_seen)
            if self.cfg.docs_per_step is not None:  # DeepSpeed's names for the step's document counts
                rep["num_documents"], rep["documents_seen"] = rep["samples"], float(progress.samples_seen)
            step_timings = {key: rep.pop(key) for key in list(rep) if key.startswith("time/")}
            if j == 0:  # rollout_generate: the engine; rollout_reward: scoring; rollout_call: the whole remote call
                step_timings.update(
                    {
                        "time/rollout_generate": t_engine,
                        "time/rollout_reward": t_reward,
                        **timings,
                        "time/rollout_total": time.perf_counter() - t0,
                    }
                )
            row = {"rollout_id": k, "step_in_rollout": j, **stats, **rep}
            self.metrics.log(progress.step, row, step_timings)
            if progress.step % self.cfg.log_interval == 0:
                (self.bar.write if self.cfg.progress_bar else print)(summary_line(progress.step, row, step_timings))
                sys.stdout.flush()

    def log_eval(self, step: int, k: int, metrics: Dict[str, float]) -> None:
        self.metrics.log(step, {"rollout_id": k, **metrics})

    def advance(self, data: RolloutData, timings: Dict[str, float], step: int) -> None:
        """The progress bar after a rollout: its reward and phase seconds."""
        stats = data.stats
        head = {"reward": f"{stats['reward_mean']:.3f}"} if "reward_mean" in stats else {}  # SFT: no reward
        self.bar.set_postfix(
            **head,
            gen_s=f"{stats.get('rollout_gen_time', 0.0):.2f}",
            reward_s=f"{stats.get('rollout_reward_time', 0.0):.2f}",
            train_s=f"{timings.get('time/train', 0.0):.2f}",
            step=step,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
