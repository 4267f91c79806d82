"""The real-model example's task: "What is a + b? Answer with the number only." as chat messages.

Writes ``train.jsonl`` and ``eval.jsonl`` (or ``.parquet`` with ``--format parquet``) under an
output directory, one record per line::

    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 + 7? ..."}],
     "label": "19", "metadata": {"a": 12, "b": 7}}

a and b are drawn uniformly from ``[0, --max-operand]`` with a fixed seed; the eval pairs are
disjoint from the training pairs (which repeat to fill ``--train``). The verifier is ``--rm-type math_exact``: the response's last
number (or last ``\\boxed{}``) must equal the sum. SmolLM2-135M-Instruct answers ~20-45% of
these right at temperature 1 before training, so GRPO has signal from the first rollout.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = "You are a calculator. Reply with the result as a number."
QUESTION = "What is {a} + {b}? Answer with the number only."


def records(pairs):
    return [
        {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "label": str(a + b),
            "metadata": {"a": a, "b": b},
        }
        for a, b in pairs
    ]


def write(rows, path: Path) -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=2000, help="training prompts")
    p.add_argument("--eval", type=int, default=64, help="held-out prompts")
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    n = a.max_operand + 1
    if a.eval >= n * n:
        p.error(f"--eval {a.eval} leaves none of the {n * n} pairs of --max-operand {a.max_operand} to train on")
    pairs = [(i, j) for i in range(n) for j in range(n)]
    random.Random(a.seed).shuffle(pairs)
    ev, tr = pairs[: a.eval], pairs[a.eval :]
    tr = [tr[i % len(tr)] for i in range(a.train)]
    a.out.mkdir(parents=True, exist_ok=True)
    for name, subset in (("train", tr), ("eval", ev)):
        print(write(records(subset), a.out / f"{name}.{a.format}"))


if __name__ == "__main__":
    main()
