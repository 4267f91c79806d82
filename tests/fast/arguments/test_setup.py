"""Setup mistakes refused (or warned) by the flag checker and the trainer's preflight, before Ray
starts (issue 38 items 1 and 10): a model without data, data without a model, expert parallelism
and MoE-only flags on a dense model, ``--seq-length`` where the layout does not read it."""

from __future__ import annotations

import argparse

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.arguments.__main__ import main as check
from rl_plugin.arguments.embedded import CHAR_TOKENIZER_FILE, EMBEDDED_DEFAULTS, is_embedded
from rl_plugin.errors import RLArgumentError
from rl_plugin.rollout.data.tokenizer import FILENAME


@pytest.fixture(scope="module")
def embedded_family(tmp_path_factory):
    from rl_plugin.loop.embedded_setup import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """--prompt-data and what it needs, for the rules that follow it."""
    path = tmp_path_factory.mktemp("data") / "d.jsonl"
    path.write_text('{"prompt": "12=", "label": "12"}\n')
    sizes = ["--rollout-batch-size", "1", "--rollout-max-response-len", "4", "--num-rollout", "1"]
    return ["--prompt-data", str(path), *sizes, "--rm-type", "digit_match"]


def _checker(capsys, argv):
    rc = check(list(argv))
    out = capsys.readouterr()
    return rc, out.err


def test_the_embedded_familys_tokenizer_file_is_the_tokenizers():
    assert CHAR_TOKENIZER_FILE == FILENAME


def test_a_users_model_without_prompt_data_is_refused_naming_prompt_data(capsys, tiny_qwen2):
    """Before: the checker and the run exit 0 and train the user's model on the digit task."""
    rc, err = _checker(capsys, ["--hf-checkpoint", tiny_qwen2])
    assert rc == 2, err
    assert f"--hf-checkpoint {tiny_qwen2} without --prompt-data" in err, err
    assert "digit-copy task" in err and f"--rm-type {EMBEDDED_DEFAULTS['rm_type']}" in err
    assert "Fix: pass --prompt-data FILE" in err and "--rollout-batch-size N" in err and "--custom-rm-path" in err
    rc, err = _checker(capsys, ["--hf-checkpoint", tiny_qwen2, "--no-file-checks"])  # the rule needs no files read
    assert rc == 2 and "without --prompt-data" in err, err


def test_a_users_model_without_prompt_data_is_refused_by_preflight(tiny_qwen2, tmp_path):
    """A run built from a Namespace (not through the trainer's parse) meets the same rule, in the
    checks the run makes on the flags as given before its preflight (``check_command_line``)."""
    from rl_plugin.arguments.setup import check_command_line

    args = parse_args(["--hf-checkpoint", tiny_qwen2, "--output-dir", str(tmp_path / "o")])
    assert not is_embedded(args)
    with pytest.raises(RLArgumentError, match="without --prompt-data"):
        check_command_line(args)


def test_the_trainer_refuses_a_users_model_without_prompt_data(capsys, tiny_qwen2):
    from rl_plugin.train import main

    assert main(["--hf-checkpoint", tiny_qwen2, "--train-backend", "fsdp"]) == 2
    assert "without --prompt-data" in capsys.readouterr().err


def test_embedded_default_and_its_family_still_run_the_digit_task(capsys, embedded_family):
    """No flags, or a checkpoint of the embedded family (char tokenizer: the tiny MoE end-to-end
    runs pass one), keep the embedded task and its defaults."""
    for argv in ([], ["--hf-checkpoint", embedded_family]):
        args = argparse.Namespace(prompt_data=None, hf_checkpoint=argv[1] if argv else None)
        assert is_embedded(args)
        rc, err = _checker(capsys, argv)
        assert rc == 0, err


def test_prompt_data_without_a_model_is_refused_by_the_checker(capsys, tmp_path):
    """Kept from before (the trainer refused it after parsing); now the checker says so too."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "12=", "label": "12"}\n')
    sizes = ["--rollout-batch-size", "1", "--rollout-max-response-len", "4", "--num-rollout", "1"]
    rc, err = _checker(capsys, ["--prompt-data", str(data), *sizes, "--rm-type", "digit_match"])
    assert rc == 2 and f"--prompt-data {data} without --hf-checkpoint" in err and "Fix: pass --hf-checkpoint" in err


def test_expert_parallelism_on_a_dense_model_is_refused_by_the_checker(capsys, tiny_qwen2, data):
    """Before: passed the checker, failed in the train actor ~17 s in."""
    argv = ["--hf-checkpoint", tiny_qwen2, *data, "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    rc, err = _checker(capsys, argv)
    assert rc == 2, err
    assert "--expert-model-parallel-size 2 with" in err and "the model is dense" in err, err
    assert "Fix: drop --expert-model-parallel-size" in err


def test_expert_parallelism_on_an_moe_model_passes(capsys, tiny_checkpoint, data):
    moe = tiny_checkpoint("qwen3_moe")  # 4 experts
    argv = ["--hf-checkpoint", moe, *data, "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    rc, err = _checker(capsys, [*argv, "--moe-aux-loss-coeff", "0.01"])
    assert rc == 0 and "warning" not in err, err


def test_moe_only_flags_on_a_dense_model_are_warned_naming_them(capsys, tiny_qwen2, data):
    argv = ["--hf-checkpoint", tiny_qwen2, *data, "--moe-aux-loss-coeff", "0.01", "--moe-router-dtype", "fp32"]
    rc, err = _checker(capsys, argv)
    assert rc == 0, err
    assert "warning: --moe-aux-loss-coeff 0.01, --moe-router-dtype fp32 with the dense model" in err, err
    assert "nothing reads these MoE-only flags" in err and "Fix: drop them" in err
    rc, err = _checker(capsys, ["--hf-checkpoint", tiny_qwen2, *data])
    assert rc == 0 and "warning" not in err, err  # the defaults are not "given"


def test_seq_length_without_bshd_is_warned_as_unread(capsys):
    rc, err = _checker(capsys, ["--seq-length", "64"])
    assert rc == 0 and "warning: --seq-length 64 with --qkv-format thd: nothing reads it" in err, err
    rc, err = _checker(capsys, ["--seq-length", "64", "--qkv-format", "bshd"])
    assert rc == 0 and "warning" not in err, err


def test_a_bad_flag_value_is_one_line_not_the_usage(capsys):
    """Before: argparse printed ~120 lines of usage before the error."""
    with pytest.raises(SystemExit) as info:
        check(["--apply-chat-template", "--apply-chat-template-kwargs", "{enable_thinking: false}"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: argument --apply-chat-template-kwargs: '{enable_thinking: false}' is not valid JSON")
