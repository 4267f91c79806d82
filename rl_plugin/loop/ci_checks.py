"""slime's in-loop checks under ``--ci-test`` (``rl_plugin.configs.ci_checks``), run by the loop at
each rollout; a failed check raises ``CiCheckFailed`` (one line) and ends the run there.

- ``check_logprobs``: ``--ci-train-rollout-logprob-abs-diff-threshold T``. After rollout k's train
  call, max_t |old_t - rollout_t| over the rollout's trained tokens must be <= T (0: bitwise). The
  old log-probs are the trainer's at the start of the rollout, i.e. of the policy that sampled it,
  in every step of the rollout (one pass before the first step, or the first and only step's own
  forward), so every step's tokens are compared. Each step reports its worst token
  (``rl_plugin.loss.worst_token``: the sample's index in the rollout, the token's position in its
  response and both values); the worst over the steps is named.
- ``check_actor_ref``: actor = reference at the first rollout (slime's step-0 check): with a
  reference model, rollout 0's old log-probs (the actor's before any update) against the reference
  model's, over every step's trained tokens; the tolerance is 0 (bitwise) under
  ``--true-on-policy-mode``, else the threshold (``rl_plugin.configs.ci_checks.actor_ref_tolerance``;
  the loop passes None, no check, when ``--load`` starts the actor from other weights than the
  reference's).
- ``sync_failure``: the weight-sync checks (``--ci-test`` turns on what ``--check-weight-sync``
  does): the engines' weight version equals the trainer's after each sync (the sync version each
  engine's receiver holds against the handle's, ``WeightVersionError``), then their weights'
  fingerprints equal the trainer's export (``rl_plugin.weight_sync.fingerprint``). A failed load is
  re-raised naming the check and the rollout whose generate loaded it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from rl_plugin.configs.ci_checks import THRESHOLD
from rl_plugin.errors import CiCheckFailed, WeightSyncError, WeightVersionError
from rl_plugin.loss import ACTOR_REF_KEYS


def check_logprobs(k: int, reports: List[Dict[str, Any]], threshold: Optional[float]) -> None:
    """Raise ``CiCheckFailed`` when rollout ``k``'s worst token (over its step ``reports``) differs
    by more than ``threshold`` (None: no check)."""
    if threshold is None:
        return
    head = f"ci-test: {THRESHOLD} {threshold:g}: rollout {k}"
    measured = [r for r in reports if r.get("mismatch/worst_old_log_prob") is not None]
    if not measured:
        if any("mismatch/worst_sample" in r for r in reports):  # measured, but no trained token anywhere
            return
        raise CiCheckFailed(
            f"{head}: no step measured the trainer/engine log-prob difference (the rollout carries no engine log-probs)"
        )

    def diff(r: Dict[str, Any]) -> float:
        return abs(r["mismatch/worst_old_log_prob"] - r["mismatch/worst_rollout_log_prob"])

    worst = max(measured, key=diff)  # the first step's on a tie
    if diff(worst) <= threshold:
        return
    raise CiCheckFailed(
        f"{head}, sample {int(worst['mismatch/worst_sample'])} token {int(worst['mismatch/worst_position'])}: "
        f"trainer log-prob {worst['mismatch/worst_old_log_prob']:.6f} vs rollout log-prob "
        f"{worst['mismatch/worst_rollout_log_prob']:.6f} (|diff| {diff(worst):.2g})"
    )


def check_actor_ref(k: int, reports: List[Dict[str, Any]], tolerance: Optional[float]) -> None:
    """Raise ``CiCheckFailed`` when rollout ``k`` is the first (0) and its worst |old - ref| token
    (over its step ``reports``, ``ACTOR_REF_KEYS``) differs by more than ``tolerance`` (None: no check)."""
    if tolerance is None or k != 0:
        return
    sample, position, old_key, ref_key = ACTOR_REF_KEYS
    head = f"ci-test: actor = reference (tolerance {tolerance:g}): rollout {k}"
    measured = [r for r in reports if r.get(old_key) is not None]
    if not measured:
        if any(sample in r for r in reports):  # measured, but no trained token anywhere
            return
        raise CiCheckFailed(f"{head}: no step compared the actor's log-probs with the reference model's")

    def diff(r: Dict[str, Any]) -> float:
        return abs(r[old_key] - r[ref_key])

    worst = max(measured, key=diff)
    if diff(worst) <= tolerance:
        return
    raise CiCheckFailed(
        f"{head}, sample {int(worst[sample])} token {int(worst[position])}: actor log-prob {worst[old_key]:.6f} vs "
        f"reference log-prob {worst[ref_key]:.6f} (|diff| {diff(worst):.2g})"
    )


def sync_failure(k: int, exc: WeightSyncError, ci_test: bool) -> WeightSyncError:
    """The weight-sync check's error ``exc`` (the version's or the fingerprint's) naming the rollout
    ``k`` whose generate loaded the weights (and ``--ci-test`` when that flag turned the check on)."""
    check = "weight version" if isinstance(exc, WeightVersionError) else "weight-sync fingerprint"
    check = f"ci-test: {check}" if ci_test else check
    return type(exc)(f"{check}: rollout {k}: {exc}")
