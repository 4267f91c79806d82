"""The checks of the files and directories the flags name (``rl_plugin.arguments.paths``): each
refusal names the flag and the path, the rule and the fix; valid paths pass."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.arguments.paths import validate_paths
from rl_plugin.checkpoint.layout import TRACKER, step_dir

# the sizes and reward a --prompt-data run names (the flag rules, checked before the paths)
SIZES = [
    "--rollout-batch-size",
    "4",
    "--rollout-max-response-len",
    "8",
    "--num-rollout",
    "2",
    "--rm-type",
    "math_exact",
]


def _refused(flags, *fragments):
    with pytest.raises(RLArgumentError) as err:
        validate_paths(parse_args([str(f) for f in flags] + SIZES))
    message = str(err.value)
    assert "Fix:" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def _saved(root, step):
    """A --save directory whose tracker names ``step`` (the checkpoint's files are not read here)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / TRACKER).write_text(str(step))
    return root


@pytest.mark.parametrize("flag", ["--prompt-data", "--eval-prompt-data"])
def test_data_file_missing_or_a_directory(flag, tmp_path):
    _refused([flag, tmp_path / "no.jsonl"], f"{flag} {tmp_path / 'no.jsonl'}: the file does not exist", "JSONL file")
    _refused([flag, tmp_path], f"{flag} {tmp_path}: the file is a directory")


def test_hf_checkpoint_rules(tmp_path):
    _refused(["--hf-checkpoint", tmp_path / "none"], "the directory does not exist", "Hugging Face model directory")
    _refused(["--hf-checkpoint", tmp_path], f"--hf-checkpoint {tmp_path}: the directory holds no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2}))
    (tmp_path / "tokenizer.json").write_text("{}")
    _refused(
        ["--hf-checkpoint", tmp_path],
        "no weight files there (*.safetensors or pytorch_model*.bin); it holds ['config.json', 'tokenizer.json']",
        "huggingface-cli download REPO --local-dir DIR",
    )


@pytest.mark.parametrize("weights", ["model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin"])
def test_hf_checkpoint_with_weights_passes(weights, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_hidden_layers": 2}))
    (tmp_path / weights).write_bytes(b"")
    validate_paths(parse_args(["--hf-checkpoint", str(tmp_path)]))


def test_custom_rm_path_with_a_syntax_error_names_its_line(tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text("def rm(args, sample):\n    return (\n")
    with pytest.raises(RLArgumentError) as err:
        validate_paths(parse_args(["--custom-rm-path", f"{rm}:rm"]))
    message = str(err.value)
    assert message.startswith(f"--custom-rm-path {rm}:rm: {rm}:2: SyntaxError: '(' was never closed"), message
    assert f"Fix: correct the module at {rm}:2." in message


def test_load_rules(tmp_path):
    _refused(["--load", tmp_path / "typo"], "the directory does not exist", f"mkdir -p {tmp_path / 'typo'}")
    (tmp_path / "f").write_text("x")
    _refused(["--load", tmp_path / "f"], "is a file, not a checkpoint directory")
    partial = tmp_path / "run" / "iter_0000002.partial"
    partial.mkdir(parents=True)
    _refused(["--load", partial], "an unfinished save", f"pass --load {tmp_path / 'run'} (its {TRACKER}")
    step = tmp_path / "run" / "iter_0000001"
    step.mkdir()
    _refused(["--load", step], "one checkpoint step inside a --save directory", f"pass --load {tmp_path / 'run'}")


def test_load_of_an_empty_or_saved_directory_passes(tmp_path):
    (tmp_path / "empty").mkdir()
    validate_paths(parse_args(["--load", str(tmp_path / "empty")]))  # start fresh
    saved = _saved(tmp_path / "run", 3)
    validate_paths(parse_args(["--load", str(saved)]))


def test_save_over_another_runs_checkpoints(tmp_path):
    saved = _saved(tmp_path / "run", 5)
    _refused(
        ["--save", saved],
        f"--save {saved}: the directory already holds a run's checkpoints up to step 5",
        "does not resume from them (no --load)",
        f"resume that run with --load {saved}, or pass --overwrite-save",
    )
    other = _saved(tmp_path / "other", 2)
    _refused(["--save", saved, "--load", other], f"resumes from --load {other}")
    validate_paths(parse_args(["--save", str(saved), "--load", str(saved)]))  # resuming it
    validate_paths(parse_args(["--save", str(saved), "--overwrite-save"]))
    validate_paths(parse_args(["--save", str(tmp_path / "new")]))  # no checkpoints there yet


def test_step_dir_names_match_the_load_rule(tmp_path):
    """The directory the step rule refuses is the one the layout writes."""
    run = tmp_path / "run"
    path = step_dir(run, 7)
    (tmp_path / "run" / "iter_0000007").mkdir(parents=True)
    assert path == str(run / "iter_0000007")
    _refused(["--load", path], "one checkpoint step inside a --save directory")
