"""The proof of ``--true-on-policy-mode`` end to end (issue 45): the embedded default (tiny Qwen2,
digit copy) with the hf engine, real Ray actors, under ``--ci-test
--ci-train-rollout-logprob-abs-diff-threshold 0`` (a single token whose trainer log-prob differs
from the engine's by any amount stops the run with exit 1).

Asserted per run: it finishes (every rollout passed the bitwise check), every rollout's logged
``mismatch/abs_diff_max`` and ``mismatch/abs_diff_mean`` are exactly 0.0, and:

- ``megatron`` / ``fsdp``: 10 rollouts each, with a reference model (``--use-kl-loss``, coefficient 0):
  the first rollout's old log-probs equal the reference model's bitwise (actor = reference, checked
  in the loop and here), and the reward rises; the FSDP run also under ``--deterministic-mode``;
- ``megatron_tp2`` / ``megatron_dp2`` / ``fsdp_dp2``: 3 rollouts on two training ranks (tensor
  parallel or data parallel): the engine's bits hold across the split (TP2 splits the embedded
  model's 16-token head into 8 columns per rank: ``inv.linear``'s ``MIN_COLS`` keeps their bits);
- ``multi_turn``: the two-turn hook of ``tests/support/turn_hooks.py`` (model turn, a masked tool
  turn, model turn) on Megatron: the tool tokens are masked (``multi_turn/masked_token_frac`` > 0)
  and the model's tokens agree bitwise.
"""

import json
from pathlib import Path
from statistics import mean

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402

HOOKS = Path(__file__).resolve().parents[2] / "support" / "turn_hooks.py"
FLAGS = [
    *("--true-on-policy-mode", "--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", "0"),
    *("--eval-interval", "100", "--no-progress-bar"),
]
TWO_RANKS = ("--actor-num-gpus-per-node", "2", "--num-rollout", "3")
RUNS = {
    "megatron": ("--train-backend", "megatron", "--num-rollout", "10", "--use-kl-loss"),
    "fsdp": ("--train-backend", "fsdp", "--num-rollout", "10", "--use-kl-loss", "--deterministic-mode"),
    "megatron_tp2": ("--train-backend", "megatron", "--tensor-model-parallel-size", "2", *TWO_RANKS),
    "megatron_dp2": ("--train-backend", "megatron", *TWO_RANKS),
    "fsdp_dp2": ("--train-backend", "fsdp", *TWO_RANKS),
    "multi_turn": (
        *("--train-backend", "megatron", "--num-rollout", "3", "--lr", "1e-3"),
        *("--custom-generate-function-path", f"{HOOKS}:two_turn", "--custom-rm-path", f"{HOOKS}:first_digit_reward"),
        *("--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "4"),
    ),
}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    """The rows of run ``name`` (one per rollout: one step each), run once per module."""
    done = {}

    def rows(name):
        if name not in done:
            d = tmp_path_factory.mktemp(name)
            assert main(["--output-dir", str(d), *FLAGS, *RUNS[name]]) == 0
            done[name] = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        return done[name]

    return rows


def _bitwise(rows, num_rollout):
    assert [r["rollout_id"] for r in rows] == list(range(num_rollout))
    for r in rows:
        assert r["mismatch/abs_diff_max"] == 0.0 and r["mismatch/abs_diff_mean"] == 0.0, r
        assert r["mismatch/worst_old_log_prob"] == r["mismatch/worst_rollout_log_prob"], r


@pytest.mark.parametrize("name", ["megatron", "fsdp"])
def test_ten_rollouts_bitwise_with_actor_equal_to_reference_and_rising_reward(run, name):
    rows = run(name)
    _bitwise(rows, 10)
    first = rows[0]
    assert first["ci/actor_ref_worst_old_log_prob"] == first["ci/actor_ref_worst_ref_log_prob"]
    rewards = [r["reward_mean"] for r in rows]
    assert mean(rewards[-3:]) > mean(rewards[:3]) + 0.03, rewards


@pytest.mark.parametrize("name", ["megatron_tp2", "megatron_dp2", "fsdp_dp2"])
def test_two_training_ranks_keep_the_engines_bits(run, name):
    _bitwise(run(name), 3)


def test_a_multi_turn_hook_with_masked_tool_tokens_stays_bitwise(run):
    rows = run("multi_turn")
    _bitwise(rows, 3)
    for r in rows:
        assert 0 < r["multi_turn/masked_token_frac"] < 1 and r["tokens"] == r["multi_turn/model_tokens"], r
