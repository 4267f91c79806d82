"""The flag checker, ``python -m rl_plugin.arguments`` (``rl_plugin.arguments.__main__.main``), in
process: the resolved settings as JSON and exit 0, a refused combination as one ``error:`` line on
stderr and exit 2, ``--no-file-checks`` checking the flags alone, the world rules for the planned
DP size. (The command as a subprocess: ``test_arguments.py``; the setup refusals:
``test_setup.py``.)"""

from __future__ import annotations

import json

from rl_plugin.arguments.__main__ import NO_FILE_CHECKS, main

DATA = "--rollout-batch-size 4 --rollout-max-response-len 8 --num-rollout 2 --rm-type math_exact"


def test_prints_the_resolved_settings_and_exits_0(capsys):
    assert main(["--n-samples-per-prompt", "4"]) == 0
    out, err = capsys.readouterr()
    settings = json.loads(out)
    assert settings["n_samples_per_prompt"] == 4
    assert settings["num_rollout"] == 300  # the embedded default, applied as the trainer applies it
    assert err == ""


def test_a_refused_combination_is_one_line_and_exit_2(capsys):
    assert main(["--save-interval", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: --save-interval without --save: ") and err.count("\n") == 1
    assert "Fix: add --save DIR, or drop --save-interval." in err


def test_no_file_checks_skips_the_files_only(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    flags = f"--hf-checkpoint {model} --prompt-data {tmp_path / 'missing.jsonl'} {DATA}".split()
    assert main(flags) == 2
    assert f"error: --prompt-data {tmp_path / 'missing.jsonl'}: the file does not exist" in capsys.readouterr().err
    assert main([*flags, NO_FILE_CHECKS]) == 0
    settings = json.loads(capsys.readouterr().out)
    assert NO_FILE_CHECKS.lstrip("-").replace("-", "_") not in settings  # a checker option, not a trainer flag
    assert settings["hf_checkpoint"] == str(model)
    # the flag rules still apply without the file checks
    assert main([*flags, NO_FILE_CHECKS, "--save-interval", "2"]) == 2


def test_the_world_rules_use_the_planned_dp_size(capsys):
    # 2 ranks, DP 2: 6 samples are not whole micro-batches of 2 on each rank
    flags = "--actor-num-gpus-per-node 2 --global-batch-size 6 --micro-batch-size 2 --rollout-batch-size 3 --n-samples-per-prompt 2"
    assert main(flags.split()) == 2
    assert "--global-batch-size 6 with --micro-batch-size 2 on 2 data-parallel ranks" in capsys.readouterr().err
    assert main(flags.replace("--global-batch-size 6", "--global-batch-size 4").replace("3 --n", "2 --n").split()) == 0
