"""slime's in-loop checks under ``--ci-test`` (``rl_plugin.configs.ci_checks``), run by the loop at
each rollout; a failed check raises ``CiCheckFailed`` (one line) and ends the run there.

- ``check_logprobs``: ``--ci-train-rollout-logprob-abs-diff-threshold T``. After rollout k's train
  call, max_t |old_t - rollout_t| over the rollout's trained tokens must be <= T (0: bitwise). The
  old log-probs are the trainer's at the start of the rollout, i.e. of the policy that sampled it,
  in every step of the rollout (one pass before the first step, or the first and only step's own
  forward), so every step's tokens are compared. Each step reports its worst token
  (``rl_plugin.loss.worst_token``: the sample's index in the rollout, the token's position in its
  response and both values); the worst over the steps is named.
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


def sync_failure(k: int, exc: WeightSyncError, ci_test: bool) -> WeightSyncError:
    """The weight-sync check's error ``exc`` (the version's or the fingerprint's) naming the rollout
    ``k`` whose generate loaded the weights (and ``--ci-test`` when that flag turned the check on)."""
    check = "weight version" if isinstance(exc, WeightVersionError) else "weight-sync fingerprint"
    check = f"ci-test: {check}" if ci_test else check
    return type(exc)(f"{check}: rollout {k}: {exc}")
