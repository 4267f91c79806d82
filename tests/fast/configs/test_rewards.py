"""The reward flags' rules (``rl_plugin.configs.rewards``): each refused combination names the
flags, the rule and the fix; slime's --rm-type spellings; the remote flags reaching the rollout
config; ``--group-rm`` with a per-sample function refused by the preflight, before Ray."""

from __future__ import annotations

import argparse

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs import RolloutConfig
from rl_plugin.configs.rewards import parse_rm_type, url_problem
from tests.support.flag_rules import assert_refused

REMOTE = "--rm-type remote_rm --rm-url http://127.0.0.1:8000/reward"

RULES = [
    ("--rm-type math_exact --custom-rm-path m:f", ["--custom-rm-path with --rm-type", "drop one of the two flags"]),
    ("--group-rm", ["--group-rm without --custom-rm-path", "pass --custom-rm-path file.py:rm"]),
    ("--group-rm --rm-type math_exact", ["--group-rm without --custom-rm-path"]),
    ("--rm-type remote_rm", ["--rm-type remote_rm without --rm-url", "pass --rm-url http://HOST:PORT/PATH"]),
    (
        "--rm-type math_exact --rm-url http://h:1/r",
        ["--rm-url without --rm-type remote_rm or --custom-rm-path", "silently ignored"],
    ),
    ("--rm-type remote_rm --rm-url ftp://h/r", ["--rm-url ftp://h/r: ", "--rm-url http://127.0.0.1:8000/reward"]),
    ("--rm-type math_exact --rm-timeout 5", ["--rm-timeout without --rm-type remote_rm or --custom-rm-path"]),
    (
        "--rm-type math_exact --rm-max-concurrency 4 --rm-max-retries 2",
        ["--rm-max-concurrency, --rm-max-retries without --rm-url", "drop them"],
    ),
    (f"{REMOTE} --rm-max-concurrency 0", ["--rm-max-concurrency: must be >= 1 (got 0)"]),
    (f"{REMOTE} --rm-timeout 0", ["--rm-timeout: must be a positive number of seconds (got 0.0)"]),
    (f"{REMOTE} --rm-timeout inf", ["--rm-timeout: must be a positive number of seconds (got inf)"]),
    (f"{REMOTE} --rm-max-retries -1", ["--rm-max-retries: must be >= 0 (got -1)"]),
    ("--rm-type remote_rm --rm-url http://h:99999/", ["--rm-url http://h:99999/", "bad port"]),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        f"{REMOTE} --rm-timeout 30 --rm-max-concurrency 8 --rm-max-retries 0",
        "--custom-rm-path m:f --rm-url http://h:1/r --rm-max-retries 2",  # an rm calling remote_rm itself
        "--custom-rm-path m:f --group-rm --rm-timeout 5",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_slime_math_is_math_exact():
    assert parse_rm_type("math") == "math_exact"
    assert parse_args(["--rm-type", "math"]).rm_type == "math_exact"
    assert parse_rm_type("anything_else") == "anything_else"  # left to argparse's choices


@pytest.mark.parametrize("value", ["deepscaler", "dapo", "f1", "boxed_math"])
def test_slime_only_verifiers_name_the_custom_rm_path(value):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_rm_type(value)
    assert f"{value!r} is one of slime's verifiers" in str(err.value)
    assert "--custom-rm-path" in str(err.value)


def test_url_problem():
    assert url_problem("http://127.0.0.1:8000/reward") is None
    assert url_problem("https://example.com") is None
    assert isinstance(url_problem("ftp://h/r"), str)
    assert isinstance(url_problem("not a url"), str)


URL = "http://127.0.0.1:9/reward"


def test_remote_flags_reach_the_rollout_config():
    args = parse_args(["--rm-type", "remote_rm", "--rm-url", URL, "--rm-max-concurrency", "5", "--rm-timeout", "2.5"])
    cfg = RolloutConfig.from_args(args)
    assert (cfg.rm_type, cfg.rm_url, cfg.rm_max_concurrency, cfg.rm_timeout, cfg.rm_max_retries) == (
        "remote_rm",
        URL,
        5,
        2.5,
        None,
    )
    assert RolloutConfig.from_args(
        parse_args(["--group-rm", "--custom-rm-path", "m:f", "--reward-key", "acc"])
    ).group_rm


def test_group_rm_with_a_per_sample_function_is_refused_before_ray(monkeypatch, tmp_path, capsys):
    import ray

    from rl_plugin.train import main

    def forbidden(*a, **k):
        raise AssertionError("the check ran after Ray started")

    monkeypatch.setattr(ray, "init", forbidden)
    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path / "cache"))
    rm = tmp_path / "rm.py"
    rm.write_text("def reward(prompt, response, label):\n    return 1.0\n")
    argv = ["--train-backend", "fsdp", "--no-progress-bar", "--num-rollout", "1", "--group-rm"]
    assert main([*argv, "--custom-rm-path", f"{rm}:reward", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--group-rm with --custom-rm-path {rm}:reward" in err and f"{rm}:1" in err and "Fix:" in err
