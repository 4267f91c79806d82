"""Bad input refused before any work, naming the file:line or the flag, the rule and the fix
(the items of the reliability sweep that need neither Ray nor a model; malformed JSON and a
missing --input-key / --label-key are in rollout/data/test_dataset, non-finite rewards in
rollout/rewards/test_functions and e2e/test_loop, another model's --load in backends/megatron/test_reshard)."""

from __future__ import annotations

import json

import pytest

from rl_plugin.rollout.data.dataset import read_jsonl


@pytest.mark.parametrize(
    "line, rule",
    [
        ('{"prompt": "", "label": "1"}', "'prompt' is empty"),
        ('{"prompt": "  \\n ", "label": "1"}', "'prompt' is empty"),
        ("{}", "no key 'prompt' (--input-key)"),
        ("null", "expected a JSON object, got NoneType"),
        ('""', "expected a JSON object, got str"),
        ('{"prompt": "12=", "label": "1"', "not valid JSON"),
    ],
)
def test_bad_prompt_line_is_named(tmp_path, line, rule):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1=", "label": "1"}\n\n' + line + "\n")  # the blank line 2 holds no record: skipped
    with pytest.raises(ValueError) as info:
        read_jsonl(p, "prompt", "label")
    assert str(info.value).startswith(f"{p}:3: {rule}"), str(info.value)


def test_blank_lines_are_skipped_and_records_kept_in_order(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"{i}=", "label": str(i)}) for i in range(3)) + "\n\n  \n")
    assert [r.prompt for r in read_jsonl(p, "prompt", "label")] == ["0=", "1=", "2="]


def test_hf_checkpoint_without_weights_is_refused_before_ray(tmp_path, capsys):
    from rl_plugin.models.tiny import tiny_config
    from rl_plugin.train import main

    model = tmp_path / "model"
    tiny_config("qwen2").save_pretrained(model)  # config.json only: an interrupted download
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12=", "label": "12"}\n')
    argv = [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "1",
        "--rm-type",
        "digit_match",
        "--output-dir",
        str(tmp_path / "o"),
        "--no-progress-bar",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"--hf-checkpoint {model}: no weight files there (*.safetensors or pytorch_model*.bin); it holds ['config.json']"
        in err
    ), err
    assert "Fix: download the complete model" in err


def test_a_typo_in_a_hook_name_is_refused_before_ray_naming_what_the_file_defines(tmp_path):
    """Issue 38 item 7: ``--custom-generate-function-path h.py:typo`` passed the checker and
    preflight (only the file was compiled) and failed ~13 s later in the rollout actor, shown as
    Ray's ``UnserializableException``. Now the real trainer refuses it in preflight: exit 2, one
    line naming the file, the missing name and the file's functions, and no Ray started."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    hook = tmp_path / "h.py"
    hook.write_text(
        "async def generate(args, sample, sampling_params):\n    return sample\n\n\ndef helper():\n    pass\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root), RAY_ADDRESS="")
    out = subprocess.run(
        [sys.executable, "-m", "rl_plugin.train", "--custom-generate-function-path", f"{hook}:typo"]
        + ["--output-dir", str(tmp_path / "o"), "--num-rollout", "1", "--no-progress-bar"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    err = out.stderr
    assert f"--custom-generate-function-path: cannot load the function '{hook}:typo'" in err, err
    assert "has no callable 'typo'; it defines: generate, helper" in err, err
    assert "Fix: correct the name after the ':'" in err, err
    assert "Traceback" not in err and "ray" not in (out.stdout + err).lower(), out.stdout + err


@pytest.mark.parametrize(
    "flag", ["--rollout-function-path", "--custom-pg-loss-reducer-function-path", "--custom-generate-function-path"]
)
def test_every_user_function_flag_is_loaded_in_preflight(tmp_path, flag):
    """Issue 38 item 7: the rollout function and the loss reducer were not loaded before the actors
    (the reducer's missing file was a raw traceback after Ray started)."""
    from rl_plugin.arguments.embedded import parse_train_flags
    from rl_plugin.configs.run import RunConfig
    from rl_plugin.errors import RLArgumentError
    from rl_plugin.loop.preflight import check_user_functions as check_run

    def check_user_functions(args):  # the run's config as the run builds it (its functions load after this)
        check_run(RunConfig.from_args(args, load_user_code=False))

    hook = tmp_path / "h.py"
    hook.write_text("def fn(*a, **k):\n    return None\n")
    args = parse_train_flags(["--output-dir", str(tmp_path / "o")])
    setattr(args, flag[2:].replace("-", "_"), f"{hook}:typo")
    with pytest.raises(RLArgumentError, match=rf"{flag}: cannot load .* has no callable 'typo'; it defines: fn"):
        check_user_functions(args)
    setattr(args, flag[2:].replace("-", "_"), f"{tmp_path / 'missing.py'}:fn")
    with pytest.raises(RLArgumentError, match=rf"{flag}: cannot load .*no such file .*missing.py"):
        check_user_functions(args)
    setattr(args, flag[2:].replace("-", "_"), f"{hook}:fn")
    check_user_functions(args)  # a function that exists passes


def test_user_function_not_found_crosses_ray_as_itself():
    """Issue 38 item 7: the exception could not be unpickled (its __init__ takes three
    arguments), so Ray showed ``UnserializableException`` instead of the message."""
    import pickle

    from rl_plugin.user_code import UserCodeError, UserFunctionNotFound

    exc = UserFunctionNotFound("--rollout-function-path", "h.py:typo", "'h.py' has no callable 'typo'")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is UserFunctionNotFound and str(back) == str(exc) and back.reason == exc.reason
    from rl_plugin.rollout.deadlines import UserCallTimeout
    from rl_plugin.rollout.generation.hooks import HookError
    from rl_plugin.rollout.rewards.functions import RewardFunctionError
    from rl_plugin.rollout.sample_check import SampleError

    for cls in (UserCodeError, RewardFunctionError, HookError, SampleError, UserCallTimeout):
        back = pickle.loads(pickle.dumps(cls("one line")))  # what the rollout actor raises, as Ray ships it
        assert type(back) is cls and str(back) == "one line"
