"""Per-rollout time of the embedded loop (``rl-plugin-train``, HF engine) for torch thread
settings of the two actors: ``RL_PLUGIN_TRAIN_THREADS`` (the train actor) and
``RL_PLUGIN_ROLLOUT_THREADS`` (the rollout manager, where the ``hf`` engine runs), in the
synchronous loop and overlapped (``--max-weight-staleness 1 --use-tis``).

In the synchronous loop the engine and the trainer take turns, so each could use every core
while the other waits; overlapped they run at the same time and share the cores. Each round runs
every setting once, in turn (the machine's speed drifts: compare within rounds). Printed: the
median over rollouts after ``--skip`` of each phase, and the ratio of ``time/rollout_total`` to
the first setting's (1/1) of the same mode. ``--check-bitwise`` also says whether each setting's
``metrics.jsonl`` is byte-identical to the 1/1 run of its mode (thread counts may change
floating-point reductions).

    python -m benchmarks.thread_settings [--backend megatron] [--rounds 2] [--num-rollout 30]
        [--settings 1/1 2/2 2/1 1/2] [--modes sync overlapped] [--check-bitwise]

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path
from statistics import median

from benchmarks._runner import ROOT, train_run

MODES = {"sync": [], "overlapped": ["--max-weight-staleness", "1", "--use-tis"]}
PHASES = ("time/rollout_total", "time/rollout_generate", "time/train_step", "time/train", "time/weight_sync")


def run(setting: str, mode: str, backend: str, out: Path, num_rollout: int) -> list:
    train, rollout = setting.split("/")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RL_PLUGIN_TRAIN_THREADS": train,
        "RL_PLUGIN_ROLLOUT_THREADS": rollout,
    }
    flags = ["--train-backend", backend, "--num-rollout", str(num_rollout), *MODES[mode]]
    return train_run(flags, out, what=f"{mode} {setting}", env=env, log=False).timings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="megatron")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-rollout", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up rollouts left out of the medians")
    p.add_argument(
        "--settings", nargs="+", default=["1/1", "2/2"], help="TRAIN/ROLLOUT thread counts; first = baseline"
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--check-bitwise", action="store_true")
    a = p.parse_args()
    rows = {}
    same = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            for mode in a.modes:
                for s in a.settings:
                    out = Path(tmp) / f"{mode}-{s.replace('/', '_')}-{i}"
                    rows.setdefault((mode, s), []).append(run(s, mode, a.backend, out, a.num_rollout)[a.skip :])
                    if a.check_bitwise:
                        base = Path(tmp) / f"{mode}-{a.settings[0].replace('/', '_')}-{i}" / "metrics.jsonl"
                        same.setdefault((mode, s), []).append(filecmp.cmp(base, out / "metrics.jsonl", shallow=False))
    print(
        f"\n{a.backend}: median ms over rollouts {a.skip + 1}..{a.num_rollout}, {a.rounds} round(s); "
        "setting = train/rollout torch threads"
    )
    head = f"{'mode':11} {'setting':7} " + " ".join(f"{k.removeprefix('time/'):>15}" for k in PHASES)
    print(head + f" {'total ratio':>11}   per-round total" + ("   bitwise" if a.check_bitwise else ""))
    for mode in a.modes:
        base = None
        for s in a.settings:
            runs = rows[mode, s]
            med = {k: 1000 * median(r[k] for rr in runs for r in rr if k in r) for k in PHASES}
            base = base or med["time/rollout_total"]
            per = " ".join(f"{1000 * median(r['time/rollout_total'] for r in rr):.1f}" for rr in runs)
            line = f"{mode:11} {s:7} " + " ".join(f"{med[k]:15.2f}" for k in PHASES)
            line += f" {med['time/rollout_total'] / base:11.3f}   {per}"
            if a.check_bitwise:
                line += f"   {'same' if all(same[mode, s]) else 'DIFFERS'}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
