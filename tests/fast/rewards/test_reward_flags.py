"""The reward flags' rules (``rl_plugin.configs.rewards``): each refusal names the flags, the
rule and the fix; ``--group-rm`` with a per-sample function is refused by the preflight, before Ray."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.configs import RolloutConfig

URL = "http://127.0.0.1:9/reward"


def _err(argv):
    with pytest.raises(RLArgumentError) as info:
        parse_args(argv)
    return str(info.value)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--rm-type", "remote_rm"], ["--rm-type remote_rm without --rm-url", "Fix: pass --rm-url http://"]),
        (
            ["--rm-url", URL],
            ["--rm-url without --rm-type remote_rm", "silently ignored", "Fix: add --rm-type remote_rm"],
        ),
        (["--rm-type", "math_exact", "--rm-url", URL], ["--rm-url without --rm-type remote_rm"]),
        (["--rm-type", "remote_rm", "--rm-url", "127.0.0.1:8000"], ["--rm-url 127.0.0.1:8000", "not an http://"]),
        (["--rm-type", "remote_rm", "--rm-url", "http://h:99999/"], ["bad port"]),
        (["--rm-timeout", "3"], ["--rm-timeout without --rm-type remote_rm"]),
        (["--custom-rm-path", "m:f", "--rm-max-concurrency", "4"], ["--rm-max-concurrency without --rm-url"]),
        (["--rm-type", "remote_rm", "--rm-url", URL, "--rm-max-concurrency", "0"], ["--rm-max-concurrency", ">= 1"]),
        (["--rm-type", "remote_rm", "--rm-url", URL, "--rm-timeout", "0"], ["--rm-timeout", "positive"]),
        (["--rm-type", "remote_rm", "--rm-url", URL, "--rm-max-retries", "-1"], ["--rm-max-retries", ">= 0"]),
        (["--group-rm"], ["--group-rm without --custom-rm-path", "Fix: pass --custom-rm-path file.py:rm"]),
        (["--group-rm", "--rm-type", "remote_rm", "--rm-url", URL], ["--group-rm without --custom-rm-path"]),
    ],
)
def test_refusals_name_flags_rule_and_fix(argv, fragments):
    msg = _err(argv)
    for f in fragments:
        assert f in msg, msg
    assert "Fix:" in msg


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
