"""Step time of the Megatron backend at pipeline parallelism on the embedded shape (CPU, gloo).

    python -m benchmarks.megatron_pipeline [--rollouts 20] [--rounds 1] [--micro-batch-size 128] [--layers 4]

Runs ``rl-plugin-train --train-backend megatron`` (the embedded default: tiny Qwen2, hidden 64,
2 layers; 16 prompts x 8 samples = 128 samples per one-step rollout) in three layouts:

- ``PP1``: one train rank;
- ``PP1xDP2``: two ranks, each with half the samples;
- ``PP2``: two ranks, one stage (one layer) each, every sample through both stages
  (megatron-core's 1F1B schedule, activations and gradients over gloo P2P);
- ``PP2xVPP2`` (with ``--layers 4``, a multiple of 4): two ranks of two model chunks each
  (``--num-layers-per-virtual-pipeline-stage layers/4``, megatron-core's interleaved schedule).

``--layers L`` runs every layout on the embedded model with L layers instead of 2 (the same
shapes, seed and character tokenizer, written once next to the embedded checkpoint).

and prints the median over rollouts (the first two dropped: warm-up) of ``time/train_step`` (the
optimizer step: forward, backward, optimizer), ``time/train`` (the train call: step, old
log-probs, export) and ``time/weight_publish``, with the ratio to PP1. ``--rounds R`` repeats
the three runs R times, alternating, and reports the median of the rounds. ``--micro-batch-size``
below 128 gives the pipeline several micro-batches to overlap (the embedded default is one).
The 2-core machine is shared with the rollout engine: read the ratios as overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks._runner import train_run

LAYOUTS = {
    "PP1": ["--actor-num-gpus-per-node", "1"],
    "PP1xDP2": ["--actor-num-gpus-per-node", "2"],
    "PP2": ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"],
}
KEYS = ("time/train_step", "time/train", "time/weight_publish")


def _medians(timings, skip: int):
    rows = timings[skip:]
    return {k: statistics.median(r[k] for r in rows) for k in KEYS}


def _embedded_model(layers: int) -> Path:
    """The embedded model (``rl_plugin.loop.embedded_setup.MODEL``) with ``layers`` layers, its tokenizer."""
    from rl_plugin.loop import embedded
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    base = embedded.ensure_tiny_model(embedded.cache_root())
    target = base.parent / f"{base.name}-layers{layers}"
    if not (target / "model.safetensors").exists():
        cfg = dict(embedded.MODEL, num_layers=layers)
        make_tiny_hf_checkpoint(target, cfg.pop("family"), seed=0, **cfg)
        for f in base.iterdir():
            if f.name not in ("config.json", "model.safetensors") and f.is_file():
                shutil.copy(f, target / f.name)
    return target


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--micro-batch-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="the embedded model's layers (4: adds PP2xVPP2)")
    a = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench_pp_"))
    flags = ["--train-backend", "megatron", "--num-rollout", str(a.rollouts)]
    flags += ["--micro-batch-size", str(a.micro_batch_size)]
    layouts = dict(LAYOUTS)
    if a.layers != 2:
        flags += ["--hf-checkpoint", str(_embedded_model(a.layers))]
    if a.layers % 4 == 0:
        layouts["PP2xVPP2"] = LAYOUTS["PP2"] + ["--num-layers-per-virtual-pipeline-stage", str(a.layers // 4)]
    runs = {name: [] for name in layouts}
    for r in range(a.rounds):
        for name, layout in layouts.items():
            run = train_run([*flags, *layout], root / f"{name}_{r}", what=f"{name} round {r}")
            runs[name].append(_medians(run.timings, skip=2))
    result = {name: {k: statistics.median(m[k] for m in ms) for k in KEYS} for name, ms in runs.items()}
    print(
        f"embedded default (tiny Qwen2, hidden 64, {a.layers} layers), 128 samples/step, micro-batch {a.micro_batch_size}, "
        f"median of rollouts 3..{a.rollouts} x {a.rounds} round(s), CPU gloo"
    )
    base = result["PP1"]
    print(f"{'layout':>8} " + " ".join(f"{k[5:] + ' (ms)':>18} {'vs PP1':>7}" for k in KEYS))
    for name, m in result.items():
        print(f"{name:>8} " + " ".join(f"{m[k] * 1e3:>18.1f} {m[k] / base[k]:>6.2f}x" for k in KEYS))


if __name__ == "__main__":
    main()
