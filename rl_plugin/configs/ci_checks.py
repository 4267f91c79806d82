"""CiChecks: slime's in-loop checks (``--ci-test``), which stop the run at the rollout where a
property that must hold does not.

- ``--ci-test`` fingerprints both sides of every weight sync and compares them bitwise (what
  ``--check-weight-sync`` does, ``rl_plugin.weight_sync.fingerprint``): an engine left on other
  weights stops the run at that rollout.
- ``--ci-train-rollout-logprob-abs-diff-threshold T`` (with ``--ci-test``): after each rollout's
  train call, the largest |old_t - rollout_t| over the rollout's trained tokens (the trainer's
  log-prob of the sampling policy against the engine's) must be <= T; 0 means bitwise. The steps
  report the worst token (``rl_plugin.loss.worst_token``); the loop compares
  (``rl_plugin.loop.ci_checks``).
- actor = reference (slime's check at the first step): with a reference model (``--use-kl-loss``),
  the first rollout's old log-probs (the actor's, before any update) must equal the reference
  model's: bitwise under ``--true-on-policy-mode``, else within the threshold
  (``actor_ref_tolerance``; no threshold and no mode: not checked). The run config sets it once.
- the weight version and fingerprints of every sync (``rl_plugin.loop.ci_checks.sync_failure``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag, runtime

GROUP = "logging"
THRESHOLD = "--ci-train-rollout-logprob-abs-diff-threshold"


@dataclass(frozen=True)
class CiChecks(Declared):
    ci_test: bool = flag(
        "--ci-test",
        action="store_true",
        group=GROUP,
        help=(
            "slime's in-loop checks: every weight sync is fingerprinted on both sides and compared bitwise "
            "(as --check-weight-sync), and with --ci-train-rollout-logprob-abs-diff-threshold the trainer's and the "
            "engine's log-probs are compared after every rollout. A failed check stops the run at that rollout with "
            "one line naming the check, the rollout and the values."
        ),
    )
    logprob_abs_diff_threshold: Optional[float] = flag(
        THRESHOLD,
        type=float,
        default=None,
        group=GROUP,
        help=(
            "With --ci-test: after each rollout's train call, the largest |trainer old log-prob - rollout log-prob| "
            "over the rollout's trained tokens must be <= T, else the run stops naming the worst token (sample and "
            "position) and both values. 0 means bitwise equal (true on-policy). slime's flag."
        ),
    )

    # the largest |old - ref| allowed at the first rollout (None: not checked); ``actor_ref_tolerance``
    actor_ref_tolerance: Optional[float] = runtime(None)

    def check(self, run) -> None:
        t = self.logprob_abs_diff_threshold
        if t is None:
            return
        if not self.ci_test:
            fail(
                f"{THRESHOLD} without --ci-test",
                "the threshold is one of the --ci-test checks and is read only under it",
                f"add --ci-test, or drop {THRESHOLD}",
            )
        if not math.isfinite(t) or t < 0:
            fail(
                f"{THRESHOLD} {t}",
                "the largest |log-prob difference| allowed must be a finite number >= 0",
                f"use e.g. {THRESHOLD} 0 (bitwise) or 1e-4",
            )
        if run.mode.trains_nll:
            fail(
                f"{THRESHOLD} with --loss-type sft_loss",
                "SFT samples nothing, so there are no engine log-probs to compare",
                f"drop {THRESHOLD}",
            )
        if run.mode.generates_ahead:
            fail(
                f"{THRESHOLD} with --max-weight-staleness 1 or --fully-async",
                "the engine then samples with weights older than the trainer's old policy, so the difference "
                "is the update, not the kernels",
                f"check the synchronous loop (drop --max-weight-staleness / --fully-async), or drop {THRESHOLD}",
            )
        if run.train.use_rollout_logprobs:
            fail(
                f"{THRESHOLD} with --use-rollout-logprobs",
                "the old log-probs are then the engine's own, so the check would compare them with themselves",
                f"drop --use-rollout-logprobs (the trainer recomputes them), or drop {THRESHOLD}",
            )


def actor_ref_tolerance(run) -> Optional[float]:
    """The actor = reference check's tolerance of the run ``run`` (a ``RunConfig``): under
    ``--ci-test`` with a reference model (``--use-kl-loss``, not SFT), 0 (bitwise) under
    ``--true-on-policy-mode``, else the log-prob threshold; None (not checked) otherwise."""
    ci = run.ci
    if not ci.ci_test or not run.train.loss.use_kl_loss or run.mode.trains_nll:
        return None
    return 0.0 if run.true_on_policy.mode else ci.logprob_abs_diff_threshold
