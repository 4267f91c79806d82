"""--true-on-policy-mode and --deterministic-mode (``rl_plugin.configs.true_on_policy``): the mode
reaches the backends and the hf engine as plain fields; it is refused with vLLM / SGLang, half
precision (bf16), LoRA, context parallelism and top-p < 1, each naming why; TIS / MIS stay allowed with a
start-up note that they are no-ops."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.run import RunConfig
from rl_plugin.configs.true_on_policy import TrueOnPolicyConfig
from tests.support.flag_rules import assert_refused

M = "--true-on-policy-mode"


def _run(*flags):
    return RunConfig.from_args(parse_args(list(flags)), load_user_code=False)


def test_the_mode_reaches_the_backends_and_the_engine_as_plain_fields():
    on = _run(M)
    assert on.true_on_policy == TrueOnPolicyConfig(mode=True, deterministic=False)
    assert on.train.true_on_policy and on.rollout.engine.true_on_policy
    off = _run("--deterministic-mode")
    assert off.true_on_policy == TrueOnPolicyConfig(mode=False, deterministic=True)
    assert not off.train.true_on_policy and not off.rollout.engine.true_on_policy
    assert _run().true_on_policy == TrueOnPolicyConfig()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_mode_with_another_engine_is_refused_naming_its_kernels(engine):
    assert_refused(
        f"{M} --rollout-engine {engine}",
        [
            f"{M} with --rollout-engine {engine}",
            f"{engine} computes with its own kernels",
            "no path that rescores its samples with the trainer's ops",
            "Fix: use --rollout-engine hf",
        ],
    )


@pytest.mark.parametrize(
    "extra, fragments",
    [
        ("--bf16", [f"{M} with --bf16", "the invariant ops compute in fp32", "drop --bf16"]),
        ("--lora-rank 8", [f"{M} with --lora-rank 8", "W x + s B (A x)", "drop --lora-rank"]),
        (
            "--context-parallel-size 2 --actor-num-gpus-per-node 2",
            [f"{M} with --context-parallel-size 2", "zigzag chunks", "--context-parallel-size 1"],
        ),
        ("--rollout-top-p 0.9", [f"{M} with --rollout-top-p 0.9", "renormalised nucleus", "--rollout-top-p 1.0"]),
    ],
)
def test_the_mode_is_refused_where_the_bits_cannot_match(extra, fragments):
    assert_refused(f"{M} {extra}", fragments)


def test_the_same_flags_pass_without_the_mode():
    for extra in (["--bf16"], ["--lora-rank", "8"], ["--rollout-top-p", "0.9"], ["--rollout-engine", "vllm"]):
        _run(*extra)


@pytest.mark.parametrize(
    "extra, kind", [("--use-tis", "TIS (--use-tis)"), ("--use-tis --tis-mode mask", "MIS (--tis-mode mask)")]
)
def test_tis_and_mis_stay_allowed_with_a_note_that_they_are_no_ops(extra, kind):
    run = _run(M, *extra.split())
    assert run.true_on_policy.note(run) == (
        f"note: {M}: {kind} is a no-op: the engine's and the trainer's log-probs are equal bitwise, so every "
        "importance weight pi_old / pi_rollout is exactly 1"
    )
    assert _run(*extra.split()).true_on_policy.note(_run(*extra.split())) is None
    assert _run(M).true_on_policy.note(_run(M)) is None
