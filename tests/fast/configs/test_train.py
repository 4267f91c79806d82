"""Start-up rules of the FSDP backend: each one raises with a message naming the flag and the fix."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args

FSDP = ["--train-backend", "fsdp", "--hf-checkpoint", "/nonexistent"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--tensor-model-parallel-size", "2"],
            ["--tensor-model-parallel-size 2", "data parallelism only", "--train-backend megatron"],
        ),
        (
            ["--context-parallel-size", "2"],
            ["--context-parallel-size 2", "data parallelism only", "--train-backend megatron"],
        ),
        (
            ["--pipeline-model-parallel-size", "2"],
            ["--pipeline-model-parallel-size 2", "data parallelism only", "set --pipeline-model-parallel-size 1"],
        ),
        (["--fp16"], ["--fp16", "no loss scaler", "use --bf16"]),
    ],
)
def test_fsdp_rules(flags, words):
    with pytest.raises(RLArgumentError) as err:
        parse_args(FSDP + flags)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_attn_implementation_only_for_fsdp():
    with pytest.raises(
        RLArgumentError,
        match=r"--fsdp-attn-implementation eager with --train-backend megatron.*only the FSDP backend reads it",
    ):
        parse_args(["--train-backend", "megatron", "--fsdp-attn-implementation", "eager"])
    args = parse_args(
        FSDP + ["--fsdp-attn-implementation", "eager", "--lr-decay-style", "cosine", "--lr-decay-iters", "10", "--bf16"]
    )
    assert args.fsdp_attn_implementation == "eager"


def test_lr_schedule_is_megatrons():
    """Megatron's OptimizerParamScheduler values: warm-up from 0, then linear / cosine decay."""
    from rl_plugin.backends.fsdp.optim import megatron_lr
    from rl_plugin.configs import OptimizerConfig

    args = OptimizerConfig.from_args(
        parse_args(
            FSDP
            + [
                "--lr",
                "1.0",
                "--min-lr",
                "0.1",
                "--lr-warmup-iters",
                "2",
                "--lr-decay-style",
                "cosine",
                "--lr-decay-iters",
                "6",
            ]
        )
    )
    got = [megatron_lr(args, s) for s in range(8)]
    assert got[:3] == [0.0, 0.5, 1.0]
    assert got[4] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert got[6] == pytest.approx(0.1) and got[7] == 0.1
