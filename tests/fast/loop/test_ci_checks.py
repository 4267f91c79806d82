"""The loop's --ci-test checks (``rl_plugin.loop.ci_checks``): the log-prob check's one line
naming the rollout, the worst token of the worst step and both values, or its pass at a threshold
the rollout keeps; and a weight sync that leaves an engine on its old weights (an engine double
answering the old weights' fingerprint) stopping the run at the rollout whose generate loaded it."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.errors import CiCheckFailed, LoopError, WeightSyncError, WeightVersionError
from rl_plugin.loop.ci_checks import check_actor_ref, check_logprobs
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.resume import Progress
from rl_plugin.loop.rollout_pieces import RolloutPieces
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.weight_sync import WeightLedger
from rl_plugin.weight_sync.fingerprint import weights_fingerprint
from rl_plugin.weight_sync.handle import SyncHandle

T = "--ci-train-rollout-logprob-abs-diff-threshold"


def _report(diff_max, sample, position, old, rollout):
    return {
        "mismatch/abs_diff_max": diff_max,
        "mismatch/worst_sample": float(sample),
        "mismatch/worst_position": float(position),
        "mismatch/worst_old_log_prob": old,
        "mismatch/worst_rollout_log_prob": rollout,
    }


REPORTS = [_report(5e-6, 1, 4, -0.5, -0.500005), _report(1.3e-5, 5, 2, -1.234567, -1.23458)]


def test_a_rollout_over_the_threshold_fails_with_one_line_naming_the_worst_token():
    with pytest.raises(CiCheckFailed) as err:
        check_logprobs(3, REPORTS, 0.0)
    assert str(err.value) == (
        f"ci-test: {T} 0: rollout 3, sample 5 token 2: trainer log-prob -1.234567 vs rollout log-prob "
        "-1.234580 (|diff| 1.3e-05)"
    )
    assert isinstance(err.value, LoopError)  # the run ends with it (exit 1)


def test_a_rollout_within_the_threshold_passes_and_no_threshold_checks_nothing():
    check_logprobs(0, REPORTS, 1e-4)
    check_logprobs(0, [{"loss": 1.0}], None)
    check_logprobs(0, [_report(None, 0, 0, None, None) | {"mismatch/worst_sample": None}], 0.0)  # nothing trained
    with pytest.raises(CiCheckFailed, match="rollout 2: no step measured"):
        check_logprobs(2, [{"loss": 1.0}], 0.0)


class _StaleEngines:
    """A rollout client whose engines answer every load with the fingerprint of the weights they
    held before it: a weight sync that left them on the old weights (``version``: the sync version
    they answer, the one given them when only the weights stayed behind)."""

    def __init__(self, old_weights, version=4):
        self.old = weights_fingerprint(old_weights)
        self.version = version

    def retrying(self, method, k, submit, first=None):
        data = RolloutData(
            tokens=torch.zeros(3, dtype=torch.long),
            total_lengths=torch.tensor([3]),
            response_lengths=torch.tensor([1]),
            rollout_log_probs=torch.zeros(1),
            rewards=torch.zeros(1),
            group_ids=torch.zeros(1, dtype=torch.long),
            num_groups=1,
        )
        data.weight_load = {"seconds": 0.0, "versions": [self.version], "fingerprints": [self.old]}
        return data

    def answered(self, data):
        return data


@pytest.mark.parametrize(
    "flag, check",
    [("--ci-test", "ci-test: weight-sync fingerprint"), ("--check-weight-sync", "weight-sync fingerprint")],
)
def test_an_engine_left_on_the_old_weights_stops_the_run_at_that_rollout(flag, check):
    old, new = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    cfg = LoopConfig.from_args(parse_train_flags([flag]))
    ledger = WeightLedger(cfg.sync)
    pieces = RolloutPieces(cfg, None, _StaleEngines(old), ledger, Progress(), lambda: "hint")
    ledger.published(SyncHandle(version=4, node_id="n0", buffer_bytes=512, fingerprint=weights_fingerprint(new)))
    ledger.give()
    with pytest.raises(WeightSyncError) as err:
        pieces.wait_generate(4, None)
    assert str(err.value).startswith(
        f"{check}: rollout 4: rollout engine 0: --check-weight-sync: rollout weights differ"
    )


@pytest.mark.parametrize(
    "flag, check", [("--ci-test", "ci-test: weight version"), ("--check-weight-sync", "weight version")]
)
def test_an_engine_still_on_the_previous_version_stops_the_run_naming_both_versions(flag, check):
    old, new = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    cfg = LoopConfig.from_args(parse_train_flags([flag]))
    ledger = WeightLedger(cfg.sync)
    pieces = RolloutPieces(cfg, None, _StaleEngines(old, version=3), ledger, Progress(), lambda: "hint")
    ledger.published(SyncHandle(version=4, node_id="n0", buffer_bytes=512, fingerprint=weights_fingerprint(new)))
    ledger.give()
    with pytest.raises(WeightVersionError) as err:
        pieces.wait_generate(4, None)
    assert str(err.value) == (
        f"{check}: rollout 4: rollout engine 0 holds weight version 3, the trainer's is 4: the engine did not load "
        "the sync"
    )


def _ref_report(sample, position, old, ref):
    return {
        "ci/actor_ref_worst_sample": float(sample),
        "ci/actor_ref_worst_position": float(position),
        "ci/actor_ref_worst_old_log_prob": old,
        "ci/actor_ref_worst_ref_log_prob": ref,
    }


def test_actor_ref_at_the_first_rollout_fails_with_one_line_naming_the_worst_token():
    reports = [_ref_report(2, 0, -0.75, -0.75), _ref_report(7, 3, -2.5, -2.5000019)]
    with pytest.raises(CiCheckFailed) as err:
        check_actor_ref(0, reports, 0.0)
    assert str(err.value) == (
        "ci-test: actor = reference (tolerance 0): rollout 0, sample 7 token 3: actor log-prob -2.500000 vs "
        "reference log-prob -2.500002 (|diff| 1.9e-06)"
    )
    check_actor_ref(0, reports, 1e-5)  # within the threshold (the mode off)
    check_actor_ref(1, reports, 0.0)  # after the first update the actor is no longer the reference
    check_actor_ref(0, reports, None)  # no reference model, or --load: not checked
    check_actor_ref(0, [_ref_report(0, 0, -1.0, -1.0)], 0.0)  # bitwise equal
    with pytest.raises(CiCheckFailed, match="rollout 0: no step compared the actor's log-probs"):
        check_actor_ref(0, [{"loss": 1.0}], 0.0)
