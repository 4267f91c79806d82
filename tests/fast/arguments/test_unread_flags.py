"""Flags nothing reads in the chosen configuration (``rl_plugin.arguments.unread_flags``): expert
parallelism on a dense model refused, the other MoE-only flags and ``--seq-length`` with thd warned
(one ``warning:`` line on stderr each), and ``given`` against the parser's defaults."""

from __future__ import annotations

import argparse

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.arguments.unread_flags import MOE_ONLY, check_layout_flags, check_model_flags, given

DENSE = {"model_type": "llama", "hidden_size": 8}


def test_given_compares_with_the_parsers_default():
    args = parse_args(["--moe-aux-loss-coeff", "0.01"])
    assert given(args, "moe_aux_loss_coeff")
    assert not given(args, "moe_z_loss_coeff")
    assert not given(
        parse_args(["--moe-token-dispatcher-type", "alltoall"]), "moe_token_dispatcher_type"
    )  # the default
    assert not given(argparse.Namespace(), "moe_aux_loss_coeff")  # absent: not given


def test_expert_parallelism_on_a_dense_model_is_refused():
    args = parse_args(["--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
    with pytest.raises(RLArgumentError) as err:
        check_model_flags(args, DENSE, "/m", experts=0)
    message = str(err.value)
    assert message.startswith("--expert-model-parallel-size 2 with /m: the model is dense")
    assert "model_type 'llama'" in message and "Fix: drop --expert-model-parallel-size" in message


def test_moe_only_flags_on_a_dense_model_are_warned(capsys):
    args = parse_args(["--moe-aux-loss-coeff", "0.01", "--moe-router-dtype", "fp32"])
    warnings = check_model_flags(args, DENSE, "/m", experts=0)
    assert warnings == [
        "--moe-aux-loss-coeff 0.01, --moe-router-dtype fp32 with the dense model /m: nothing reads these MoE-only flags "
        "(its config.json names no routed experts), so the run trains as without them. Fix: drop them, or use an MoE "
        "checkpoint"
    ]
    assert capsys.readouterr().err == f"warning: {warnings[0]}\n"


def test_nothing_to_say_on_an_moe_model_or_without_moe_flags(capsys):
    args = parse_args(
        ["--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    )
    assert check_model_flags(args, DENSE, "/m", experts=8) == []
    assert check_model_flags(parse_args([]), DENSE, "/m", experts=0) == []
    assert capsys.readouterr().err == ""


def test_moe_only_names_flags_of_the_parser():
    args = parse_args([])
    for flag, dest in MOE_ONLY:
        assert hasattr(args, dest), flag
        assert flag.lstrip("-").replace("-", "_") == dest


def test_seq_length_with_thd_is_warned(capsys):
    warnings = check_layout_flags(parse_args(["--seq-length", "64"]))
    assert len(warnings) == 1 and warnings[0].startswith("--seq-length 64 with --qkv-format thd: nothing reads it")
    assert "Fix: drop --seq-length, or add --qkv-format bshd" in warnings[0]
    assert capsys.readouterr().err == f"warning: {warnings[0]}\n"


def test_seq_length_with_bshd_is_read(capsys):
    assert check_layout_flags(parse_args(["--seq-length", "64", "--qkv-format", "bshd"])) == []
    assert check_layout_flags(parse_args([])) == []
    assert capsys.readouterr().err == ""
