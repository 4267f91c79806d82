"""The reward curve PNG written at the end of a run (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rl_plugin.loop.logger import read_metrics


def reward_by_rollout(metrics_file):
    """``{rollout_id: reward_mean}`` from a metrics file (the last line wins for a rollout
    re-run after a resume); eval rewards separately."""
    train, evals = {}, {}
    for row in read_metrics(metrics_file):
        if "eval/reward_mean" in row:
            evals[row["rollout_id"]] = row["eval/reward_mean"]
        elif "reward_mean" in row:
            train[row["rollout_id"]] = row["reward_mean"]
    return dict(sorted(train.items())), dict(sorted(evals.items()))


def plot_reward_curve(metrics_file, out_png, title: Optional[str] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = reward_by_rollout(metrics_file)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(train), list(train.values()), label="train reward (mean per rollout)", lw=1)
    if evals:
        ax.plot(list(evals), list(evals.values()), "o-", label="eval reward (held-out)")
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    ax.set_ylim(0, max(1.0, max(train.values(), default=1.0)))
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
