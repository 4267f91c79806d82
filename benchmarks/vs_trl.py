"""Benchmark: rl-plugin-train against TRL's GRPOTrainer on the embedded digit-copy task.

Both learn the same task (``rl_plugin.rollout.data.task``: copy 3 digits, partial-credit reward) from
the same tiny Qwen2 checkpoint and character tokenizer (``rl_plugin.loop.embedded_setup``), with the
same prompts per step, samples per prompt, response length, learning rate, optimizer (Adam,
betas (0.9, 0.98), eps 1e-8, no weight decay, grad-norm clip 1.0, constant LR), clip range
(0.2 / 0.28), no KL term (TRL beta = 0), temperature 1 / top-p 1 / no top-k, GRPO advantages
(group mean and std) and one optimizer step per rollout (TRL steps_per_generation = 1). The loss
aggregation maps TRL's ``loss_type`` onto ``--loss-aggregation``:

    grpo    -> sample_mean   (mean over samples of each sample's token mean)
    dapo    -> token_mean    (mean over all response tokens of the step)
    dr_grpo -> constant      (token sum / max_completion_length, mean over samples)

The reward is the same function on the same decoding (``CharTokenizer.decode`` of the completion
ids, stopping at <eos>). Both generate with Hugging Face ``generate`` on the CPU (rl_plugin's
``--rollout-engine hf``; TRL without vLLM). Known differences: TRL divides by (std + 1e-4),
rl_plugin by (std + 1e-6); TRL shuffles prompts, rl_plugin reads them in order; sampling RNGs
differ. One run each, the two in separate processes one after the other on the same machine.

Printed, per seed: per threshold of the reward (mean over a trailing window of ``--window`` steps), the
step and the loop time (sum of per-step wall times, start-up and eval excluded) at which each run
first reaches it, and rl_plugin / TRL ratios; the median per-step time; the process wall time. Steps to a threshold
vary by up to 2x from seed to seed on both sides, so ``--seeds`` runs several seeds (per seed:
every rl_plugin ``--variant``, then TRL, one after the other) and prints a summary: per variant and
threshold, in how many seeds each side reached it and the median over seeds of the per-seed time
and step ratios (``summary.json`` beside the runs). Not a test: numbers depend on the machine and
its load (this 2-core VM's speed drifts by up to ~1.35x over minutes: compare within a seed).

    python -m benchmarks.vs_trl [--steps 300] [--loss-type grpo] [--thresholds 0.3 0.4 0.5]
        [--backend megatron] [--seeds 1 2 3 4 5] [--variant sync= --variant overlap='--max-weight-staleness 1 --use-tis']
        [-- extra rl-plugin-train flags for every variant]

Needs the ``bench`` extra (``pip install -e .[bench]``: TRL, a benchmark-only dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Dict, List, Optional, Tuple

from benchmarks._compare import first_reaching, fmt, parse_variants, ratio
from benchmarks._runner import ROOT, rewards, train_run
from benchmarks._trl import matched_grpo_config

LOSS_TYPES = {
    "grpo": ("sample_mean", []),
    "dapo": ("token_mean", []),
    "dr_grpo": ("constant", ["--loss-aggregation-divisor"]),
}


def run_rl_plugin(a, out: Path, extra: List[str], variant: str = "") -> Dict:
    """``python -m rl_plugin.train`` (what ``rl-plugin-train`` runs) on the embedded task."""
    aggregation, needs_divisor = LOSS_TYPES[a.loss_type]
    cmd = [
        "--train-backend",
        a.backend,
        "--rollout-engine",
        a.rollout_engine,
        "--num-rollout",
        str(a.steps),
        "--rollout-batch-size",
        str(a.prompts),
        "--n-samples-per-prompt",
        str(a.samples),
        "--rollout-max-response-len",
        str(a.response_len),
        "--lr",
        str(a.lr),
        "--loss-aggregation",
        aggregation,
        "--eps-clip",
        "0.2",
        "--eps-clip-high",
        "0.28",
        "--rollout-temperature",
        "1.0",
        "--rollout-top-p",
        "1.0",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.98",
        "--adam-eps",
        "1e-8",
        "--weight-decay",
        "0",
        "--clip-grad",
        "1.0",
        "--lr-decay-style",
        "constant",
        "--seed",
        str(a.seed),
        "--eval-interval",
        str(a.steps + 1),
    ]
    cmd += [needs_divisor[0], str(a.response_len)] if needs_divisor else []
    done = train_run([*cmd, *extra], out, what=f"rl_plugin {variant or a.backend}")
    wall = done.wall_s
    reward = rewards(done.rows)
    timings = done.timings
    step_s = [t["time/rollout_total"] for t in timings if "time/rollout_total" in t]
    phases = {
        k: median(t[k] for t in timings if k in t)
        for k in sorted({k for t in timings for k in t if k.startswith("time/")})
    }
    return dict(
        name=f"rl_plugin ({a.backend}, {a.rollout_engine}{', ' + variant if variant else ''})",
        rewards=[reward[k] for k in sorted(reward)],
        step_s=step_s,
        wall_s=wall,
        phases=phases,
    )


def char_tokenizer_as_hf(model_dir: str):
    """The embedded character tokenizer as a ``PreTrainedTokenizerFast`` (what TRL needs): the same
    ids (<pad> 0, <bos> 1, <eos> 2, '=' 3 as <sep>, then the digits) and <bos> prepended, checked
    against ``CharTokenizer.prompt_ids``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from rl_plugin.rollout.data.tokenizer import SPECIALS, CharTokenizer

    char = CharTokenizer.load(model_dir)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab["="] = vocab.pop("<sep>")
    vocab.update({c: i + len(SPECIALS) for i, c in enumerate(char.alphabet)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", char.bos_token_id)])
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    for text in ("314=", "0987654321="):
        if hf(text)["input_ids"] != char.prompt_ids(text):
            raise RuntimeError(
                f"the HF copy of the char tokenizer encodes {text!r} as {hf(text)['input_ids']}, rl_plugin as {char.prompt_ids(text)}"
            )
    return hf, char


def trl_worker(a) -> None:
    """One TRL GRPOTrainer run (in its own process); writes rewards and step times to ``a.trl_worker``."""
    import torch

    if a.trl_threads > 0:  # 0 (the default): TRL as a user runs it, torch's own thread count
        torch.set_num_threads(a.trl_threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rl_plugin.loop.embedded_setup import cache_root, ensure_task_data, ensure_tiny_model
    from rl_plugin.rollout.data.task import digit_match_reward

    model_dir = ensure_tiny_model(cache_root())
    train, _ = ensure_task_data(cache_root())
    hf_tok, char = char_tokenizer_as_hf(str(model_dir))
    data = Dataset.from_list([json.loads(x) for x in Path(train).read_text().splitlines()])

    def digit_match(prompts, completions, completion_ids, label, **_):
        return [digit_match_reward(char.decode(ids), str(lab)) for ids, lab in zip(completion_ids, label)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_s, self.rewards, self.last = [], [], None

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])  # its time counts in the next step's

    with tempfile.TemporaryDirectory() as tmp:
        cfg = matched_grpo_config(
            tmp,
            steps=a.steps,
            prompts=a.prompts,
            samples=a.samples,
            response_len=a.response_len,
            lr=a.lr,
            seed=a.seed,
            loss_type=a.loss_type,
        )
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        clock = Clock()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=digit_match,
            args=cfg,
            train_dataset=data,
            processing_class=hf_tok,
            callbacks=[clock],
        )
        trainer.train()
    Path(a.trl_worker).write_text(
        json.dumps(dict(rewards=clock.rewards, step_s=clock.step_s, threads=torch.get_num_threads()))
    )


def run_trl(a, out: Path) -> Dict:
    result = out.with_suffix(".json")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.vs_trl",
        "--trl-worker",
        str(result),
        "--steps",
        str(a.steps),
        "--prompts",
        str(a.prompts),
        "--samples",
        str(a.samples),
        "--response-len",
        str(a.response_len),
        "--lr",
        str(a.lr),
        "--loss-type",
        a.loss_type,
        "--seed",
        str(a.seed),
        "--trl-threads",
        str(a.trl_threads),
    ]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"TRL worker exited {rc}; see {out.with_suffix('.log')}")
    res = json.loads(result.read_text())
    return dict(
        name=f"TRL {version('trl')} GRPOTrainer ({res['threads']} thr)",
        rewards=res["rewards"],
        step_s=res["step_s"],
        wall_s=wall,
        phases={},
    )


def version(pkg: str) -> str:
    from importlib.metadata import version as v

    return v(pkg)


def print_seed_table(a, runs: List[Dict]) -> List[List[Tuple[Optional[int], Optional[float]]]]:
    """One seed's table (as before: steps and loop seconds to each threshold, ms/step, final
    reward, process wall time; a ratio row per rl_plugin variant against TRL). Returns, per run,
    the (step, seconds) cells."""
    head = f"{'run':52} " + " ".join(f"{'step@' + str(t):>8} {'s@' + str(t):>7}" for t in a.thresholds)
    print(head + f" {'ms/step':>8} {'final':>6} {'wall s':>7}")
    reached = []
    for r in runs:
        cells = [first_reaching(r["rewards"], r["step_s"], t, a.window) for t in a.thresholds]
        reached.append(cells)
        final = sum(r["rewards"][-a.window :]) / a.window
        print(
            f"{r['name']:52} "
            + " ".join(f"{fmt(s, '8d')} {fmt(w, '7.1f')}" for s, w in cells)
            + f" {1000 * median(r['step_s']):8.1f} {final:6.3f} {r['wall_s']:7.1f}"
        )
    trl, trl_cells = runs[-1], reached[-1]
    if trl["name"].startswith("TRL"):
        for r, cells in zip(runs[:-1], reached[:-1]):
            print(
                f"{'ratio / TRL: ' + r['name'][len('rl_plugin ') :]:52} "
                + " ".join(f"{ratio(s0, s1):>8} {ratio(w0, w1):>7}" for (s0, w0), (s1, w1) in zip(cells, trl_cells))
                + f" {ratio(median(r['step_s']), median(trl['step_s'])):>8} {'':6} {ratio(r['wall_s'], trl['wall_s']):>7}"
            )
    for r in runs:
        if r["phases"]:
            print(
                f"{r['name']} median per step (ms): "
                + ", ".join(f"{k[5:]} {1000 * v:.1f}" for k, v in r["phases"].items())
            )
    return reached


def print_summary(a, names: List[str], per_seed: List[Tuple[int, List[Dict], list]]) -> Dict:
    """Over the seeds, per rl_plugin variant and threshold: in how many seeds each side reached
    it, and the median over the seeds where both did of the loop-time and step ratios to TRL;
    the median ms/step ratio. Each seed's TRL run is its own baseline (same seed, same session)."""
    print(
        f"\nsummary over seeds {[s for s, _, _ in per_seed]} (median of per-seed ratios rl_plugin / TRL; n = seeds where both reached)"
    )
    print(f"{'variant':28} {'threshold':>9} {'reached':>9} {'time ratio':>10} {'step ratio':>10} {'ms/step ratio':>13}")
    summary = {}
    for v, name in enumerate(names):
        step_ratio = median(median(runs[v]["step_s"]) / median(runs[-1]["step_s"]) for _, runs, _ in per_seed)
        for t_i, t in enumerate(a.thresholds):
            both = [(cells[v][t_i], cells[-1][t_i]) for _, _, cells in per_seed]
            ok = [(o, r) for o, r in both if o[0] is not None and r[0] is not None]
            ours_n = sum(o[0] is not None for o, _ in both)
            trl_n = sum(r[0] is not None for _, r in both)
            time_r = median(o[1] / r[1] for o, r in ok) if ok else None
            steps_r = median(o[0] / r[0] for o, r in ok) if ok else None
            print(
                f"{name:28} {t:9.2f} {f'{ours_n}|{trl_n}/{len(both)}':>9} {fmt(time_r, '10.2f')} {fmt(steps_r, '10.2f')} {step_ratio:13.2f}"
            )
            summary[f"{name}@{t}"] = dict(
                reached_rl_plugin=ours_n,
                reached_trl=trl_n,
                seeds=len(both),
                time_ratio=time_r,
                step_ratio=steps_r,
                ms_per_step_ratio=step_ratio,
            )
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (= rollouts) of each run")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (--rollout-batch-size)")
    p.add_argument(
        "--samples", type=int, default=8, help="samples per prompt (--n-samples-per-prompt / num_generations)"
    )
    p.add_argument("--response-len", type=int, default=4, help="--rollout-max-response-len / max_completion_length")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--loss-type",
        choices=sorted(LOSS_TYPES),
        default="grpo",
        help="TRL's loss_type; mapped onto --loss-aggregation",
    )
    p.add_argument("--seed", type=int, default=1234, help="one seed (see --seeds)")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="several seeds: per seed every rl_plugin variant then TRL, then a summary of the per-seed ratios",
    )
    p.add_argument(
        "--variant",
        action="append",
        help="NAME=FLAGS: an rl_plugin run with these extra flags (repeatable), e.g. "
        "--variant sync= --variant overlap='--max-weight-staleness 1 --use-tis'",
    )
    p.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"])
    p.add_argument("--rollout-engine", default="hf")
    p.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="torch threads of the TRL process (0, the default: TRL as a user runs it, torch's own thread count; "
        "rl_plugin's train actor and engine use 1 each, RL_PLUGIN_TRAIN_THREADS / RL_PLUGIN_ROLLOUT_THREADS)",
    )
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    p.add_argument("--window", type=int, default=10, help="steps in the trailing reward mean compared with a threshold")
    p.add_argument("--only", choices=["rl_plugin", "trl"], help="run one side only (debugging)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_vs_trl"))
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if a.trl_worker:
        trl_worker(a)
        return 0
    variants = parse_variants(a.variant, extra)
    seeds = a.seeds or [a.seed]
    root = Path(a.out)
    per_seed = []
    for seed in seeds:
        a.seed = seed
        out = root / f"seed{seed}" if len(seeds) > 1 else root
        out.mkdir(parents=True, exist_ok=True)
        runs = []
        if a.only != "trl":
            runs += [run_rl_plugin(a, out / f"rl_plugin{'_' + n if n else ''}", flags, n) for n, flags in variants]
        if a.only != "rl_plugin":
            runs.append(run_trl(a, out / "trl"))
        print(
            f"\nseed {seed}: {a.steps} steps x {a.prompts} prompts x {a.samples} samples, response <= {a.response_len}, "
            f"lr {a.lr}, loss {a.loss_type}, threads {os.environ.get('RL_PLUGIN_TRAIN_THREADS', 'default')}; "
            f"reward = trailing {a.window}-step mean",
            flush=True,
        )
        per_seed.append((seed, runs, print_seed_table(a, runs)))
    if len(seeds) > 1 and a.only is None:
        summary = print_summary(a, [n or "sync" for n, _ in variants], per_seed)
        (root / "summary.json").write_text(
            json.dumps(dict(seeds=seeds, thresholds=a.thresholds, summary=summary), indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
