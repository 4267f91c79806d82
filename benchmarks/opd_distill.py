"""Benchmark (issue 35): on-policy distillation on the embedded task. A teacher is the embedded
default trained to the end (``--save-hf``); a FRESH embedded student then trains for the same
number of rollouts with GRPO alone and with GRPO + OPD from that teacher (``--use-opd``), and,
optionally, with pure OPD (a constant reward, ``--pure``; its rewards, eval included, are that
constant, so only its reverse KL is printed). Prints, per student: the held-out
reward (``eval/reward_mean``) at the end, the mean train reward over the last 10 rollouts and
``opd/reverse_kl`` over the first and the last 5 rollouts. Not a test: numbers depend on the
machine; measured ones are in docs/benchmarks.md.

    python -m benchmarks.opd_distill [--backend fsdp] [--rollouts 30] [--teacher-rollouts 300] [--pure]
                                     [--coef 1.0] [--teacher DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean

from benchmarks._runner import ROOT, read_jsonl, rewards, train_run

CONSTANT_RM = "def rm(prompt, response, label):\n    return 1.0\n"


def student(backend: str, out: Path, rollouts: int, extra) -> dict:
    flags = ["--train-backend", backend, "--num-rollout", str(rollouts), "--eval-interval", str(rollouts), *extra]
    rows = train_run(flags, out, what=out.name).rows
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    r = list(rewards(rows).values())
    rkl = [x["opd/reverse_kl"] for x in rows if "opd/reverse_kl" in x]
    return dict(
        run=out.name,
        eval_reward=evals[-1],
        last10=mean(r[-10:]),
        rkl_first5=mean(rkl[:5]) if rkl else float("nan"),
        rkl_last5=mean(rkl[-5:]) if rkl else float("nan"),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="fsdp")
    p.add_argument("--rollouts", type=int, default=30)
    p.add_argument("--teacher-rollouts", type=int, default=300)
    p.add_argument("--pure", action="store_true", help="also pure OPD (a constant reward)")
    p.add_argument("--coef", type=float, default=1.0, help="--opd-kl-coef")
    p.add_argument("--teacher", default=None, help="an existing teacher run's directory (its hf/ is used)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_opd"))
    a = p.parse_args(argv)
    out = Path(a.out)
    t = Path(a.teacher) if a.teacher else out / "teacher"
    if not a.teacher:
        train_run(
            ["--train-backend", a.backend, "--num-rollout", str(a.teacher_rollouts), "--save", str(t / "ckpt")]
            + ["--save-hf", str(t / "hf")],
            t,
            what="teacher",
        )
    teacher = [r["eval/reward_mean"] for r in read_jsonl(t / "metrics.jsonl") if "eval/reward_mean" in r]
    opd = ["--use-opd", "--opd-teacher-load", str(t / "hf"), "--opd-kl-coef", str(a.coef)]
    table = [
        student(a.backend, out / "grpo", a.rollouts, []),
        student(a.backend, out / "grpo_opd", a.rollouts, opd),
    ]
    if a.pure:
        rm = out / "constant_rm.py"
        rm.write_text(CONSTANT_RM)
        table.append(student(a.backend, out / "pure_opd", a.rollouts, [*opd, "--custom-rm-path", f"{rm}:rm"]))
    print(f"teacher ({t}): eval reward {teacher[-1]:.3f}; students: {a.rollouts} rollouts, --opd-kl-coef {a.coef}")
    print(f"{'student':<10} {'eval reward':>12} {'reward last10':>14} {'rev-KL first5':>14} {'rev-KL last5':>13}")
    for row in table:
        # pure OPD is scored by its constant reward (eval too): only its reverse KL says anything
        rewards_ = (
            "           -              -"
            if row["run"] == "pure_opd"
            else (f"{row['eval_reward']:>12.3f} {row['last10']:>14.3f}")
        )
        print(f"{row['run']:<10} {rewards_} {row['rkl_first5']:>14.4f} {row['rkl_last5']:>13.4f}")


if __name__ == "__main__":
    main()
