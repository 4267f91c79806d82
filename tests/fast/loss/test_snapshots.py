"""Loss snapshots (bitwise on the writing machine): a refactor that changes any number of the core shows up here.

Values are fp64 J of a fixed step (``make_step`` of the parity test) per mode and policy loss, on
one process through ``prepare_step`` / ``ctx.loss``, stored as float.hex(). If a change is
intended, regenerate with ``python -m tests.fast.loss.test_snapshots`` and say why in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rl_plugin.loss import LossConfig, prepare_step
from rl_plugin.loss.batch import StepBatch
from rl_plugin.parallel import ParallelState
from tests.fast.parity.test_loss_layouts import DIVISOR, make_step
from tests.support.tolerance import FP64, max_abs, within

SNAPSHOT = Path(__file__).with_name("loss_snapshots.json")


def compute():
    step = make_step(seed=11, tool_turn=False)
    batch = StepBatch(
        tokens=step["tokens"],
        total_lengths=step["total"],
        response_lengths=step["resp"],
        loss_mask=step["mask"],
        advantages=step["adv"],
        group_ids=step["groups"],
        old_log_probs=step["old"],
        ref_log_probs=step["ref"],
    )
    out = {}
    for policy in ("ppo_clip", "gspo"):
        for mode in ("sample_mean", "token_mean", "prompt_mean", "constant"):
            cfg = LossConfig(
                loss_aggregation=mode,
                loss_aggregation_divisor=DIVISOR if mode == "constant" else None,
                policy_loss=policy,
                eps_clip=0.2,
                eps_clip_high=0.28,
                use_kl_loss=True,
                kl_loss_coef=0.05,
                entropy_coef=0.01,
            )
            ctx = prepare_step(batch, cfg, ParallelState.single())
            mb = ctx.micro_batch(torch.arange(batch.num_samples))
            lp = step["logp"][mb.layout.resp_index]
            ctx.loss(lp, step["ent"][mb.layout.resp_index], mb)
            report = ctx.finish()
            out[f"{policy}/{mode}"] = {
                k: float(report[k]).hex() for k in ("loss", "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac")
            }
    return out


def test_loss_snapshots_are_stable():
    """Exact on the machine that wrote them; compared within ``tolerance.FP64`` of the magnitude of
    the step's per-token terms (log-probs, advantages, entropies: ~3), so that a CPU with other SIMD
    reduction orders or exp/log kernels does not fail (a KL of 0.008 is a mean of log-prob
    differences of ~3), while any real change of the math (>= 1e-9) does."""
    got, want = compute(), json.loads(SNAPSHOT.read_text())
    step = make_step(seed=11, tool_turn=False)
    scale = max_abs(step["logp"], step["old"], step["ref"], step["adv"], step["ent"])
    assert got.keys() == want.keys()
    for key in want:
        for name, hexval in want[key].items():
            a, b = float.fromhex(got[key][name]), float.fromhex(hexval)
            assert within(a, b, rtol=FP64, scale=scale), f"{key} {name}: {a!r} != snapshot {b!r}"


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
