"""Benchmark: the per-rollout cost of ``--true-on-policy-mode`` in the whole loop (``rl-plugin-train``,
hf engine), against the default path in the same session.

For each model (``embedded``: the embedded default, tiny Qwen2 digit copy; ``smollm2``:
SmolLM2-135M-Instruct with its chat template on ``examples/addition_data.py``, as
``benchmarks.real_model`` sets it up) and each ``--backends`` entry, every round runs the default
path and the mode one after the other (the order alternating between rounds: the machine's speed
drifts), each in its own process. Printed per (model, backend): the median over the rollouts after
``--skip`` of ``time/rollout_total`` (one rollout: generate, log-probs, train, weight sync),
``time/rollout_generate`` and ``time/train``, the ratio mode / default of each (> 1: the mode is
slower), the largest ``mismatch/abs_diff_max`` over the run's rollouts (the mode's must be 0.0) and
the last rollouts' reward. ``benchmarks.true_on_policy`` times the pieces (engine tokens/s, trainer
forward, single ops) instead.

    python -m benchmarks.true_on_policy_loop [--models embedded smollm2] [--backends megatron fsdp]
        [--rounds 1] [--num-rollout 6] [--smollm2-rollouts 4] [--skip 1] [--flags '...']

Not a test: the numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path
from statistics import mean, median
from typing import Dict, List

from benchmarks._runner import train_run

MODE = ["--true-on-policy-mode"]
PHASES = {"rollout": "time/rollout_total", "generate": "time/rollout_generate", "train": "time/train"}


def smollm2_flags(out: Path, rollouts: int) -> List[str]:
    """SmolLM2-135M-Instruct on the addition task, chat template on (``benchmarks.real_model``'s
    shape: 4 prompts x 8 samples, 16 new tokens, one optimizer step per rollout)."""
    from benchmarks.real_model import prepare

    ckpt, data = prepare(out)
    return [
        *("--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--input-key", "messages"),
        *("--apply-chat-template", "--rm-type", "math_exact", "--num-rollout", str(rollouts)),
        *("--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "16"),
        *("--global-batch-size", "32", "--micro-batch-size", "8", "--lr", "1e-5"),
    ]


def one_run(flags: List[str], out: Path, what: str, skip: int) -> Dict:
    done = train_run(flags, out, what=what)
    timings = [t for t in done.timings if "time/rollout_total" in t][skip:]
    rows = [r for r in done.rows if "reward_mean" in r]
    return dict(
        phases={name: median(t.get(key, 0.0) for t in timings) for name, key in PHASES.items()},
        mismatch=max(r.get("mismatch/abs_diff_max", float("nan")) for r in rows),
        reward=mean(r["reward_mean"] for r in rows[-3:]),
        wall_s=done.wall_s,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["embedded", "smollm2"], choices=["embedded", "smollm2"])
    p.add_argument("--backends", nargs="+", default=["megatron", "fsdp"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-rollout", type=int, default=6, help="rollouts of an embedded run")
    p.add_argument("--smollm2-rollouts", type=int, default=4)
    p.add_argument("--skip", type=int, default=1, help="warm-up rollouts left out of the medians")
    p.add_argument("--flags", default="", help="more flags for every run")
    a = p.parse_args(argv)
    extra = shlex.split(a.flags)
    results: Dict[tuple, List[Dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(a.rounds):
            for model in a.models:
                base = (
                    ["--num-rollout", str(a.num_rollout), "--eval-interval", "1000"]
                    if model == "embedded"
                    else smollm2_flags(tmp, a.smollm2_rollouts)
                )
                for backend in a.backends:
                    order = ["default", "mode"] if i % 2 == 0 else ["mode", "default"]
                    for name in order:
                        flags = ["--train-backend", backend, *base, *(MODE if name == "mode" else []), *extra]
                        out = tmp / f"{model}-{backend}-{name}-{i}"
                        run = one_run(flags, out, f"{model} {backend} {name} round {i}", a.skip)
                        results.setdefault((model, backend, name), []).append(run)
    print(f"\nmedian seconds per rollout (after {a.skip} warm-up), {a.rounds} round(s); ratio = mode / default")
    head = f"{'model':9} {'backend':9} {'path':8}" + "".join(f" {k:>9}" for k in PHASES)
    print(head + "".join(f" {k + ' x':>10}" for k in PHASES) + f" {'max |diff|':>11} {'reward':>7}")
    for model in a.models:
        for backend in a.backends:
            runs = {n: results[model, backend, n] for n in ("default", "mode")}
            med = {n: {k: median(r["phases"][k] for r in rs) for k in PHASES} for n, rs in runs.items()}
            for n, rs in runs.items():
                line = f"{model:9} {backend:9} {n:8}" + "".join(f" {med[n][k]:9.3f}" for k in PHASES)
                line += "".join(f" {med[n][k] / med['default'][k]:10.2f}" for k in PHASES)
                line += f" {max(r['mismatch'] for r in rs):11.3g} {mean(r['reward'] for r in rs):7.3f}"
                print(line)


if __name__ == "__main__":
    main()
