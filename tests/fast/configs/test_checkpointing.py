"""The checkpoint flags' rules (``rl_plugin.configs.checkpointing``): each refused combination
names the flags, the rule and the fix."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.checkpointing import CheckpointConfig, same_dir
from tests.support.flag_rules import assert_refused

RULES = [
    ("--save-interval 2", ["--save-interval without --save", "silently ignored", "add --save DIR"]),
    ("--save-interval 0 --save d", ["--save-interval: must be >= 1 (got 0)", "--save-interval 10 (rollouts)"]),
    ("--overwrite-save", ["--overwrite-save without --save", "there is no checkpoint directory to overwrite"]),
    (
        "--overwrite-save --save /tmp/ck --load /tmp/ck/",
        ["--overwrite-save with --load and --save the same directory", "drop --overwrite-save to resume"],
    ),
    ("--save d --save-retain 0", ["--save-retain: must be >= 1 (got 0)", "keep at least 1"]),
    ("--save d --save-retain-interval 5", ["--save-retain-interval: needs --save-retain and a value >= 1 (got 5)"]),
    ("--save d --save-retain 2 --save-retain-interval 0", ["--save-retain-interval", "(got 0)"]),
    ("--ckpt-step 3", ["--ckpt-step: names a step of the --load directory", "(got 3, --load None)", "pass --load DIR"]),
    ("--load d --ckpt-step -1", ["--ckpt-step", "(got -1, --load d)"]),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        "--save d --save-interval 2",
        "--save /tmp/a --load /tmp/b --overwrite-save",
        "--save d --save-retain 2 --save-retain-interval 10",
        "--load d --ckpt-step 0",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_same_dir_compares_real_paths(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert same_dir(str(tmp_path / "a"), str(tmp_path / "link"))
    assert same_dir(str(tmp_path / "a"), f"{tmp_path}/x/../a/")
    assert not same_dir(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not same_dir(None, str(tmp_path)) and not same_dir(None, None)


def test_defaults():
    assert CheckpointConfig() == CheckpointConfig(None, None, None, None, None, None, False)
