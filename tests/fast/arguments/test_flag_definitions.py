"""How the flags are defined: once each, slime's spellings accepted, and validation that does not
depend on the order the configs' rules and the flag modules run in."""

import argparse
import copy

import pytest

from rl_plugin.arguments import RLArgumentError, build_parser, parse_args
from rl_plugin.arguments._util import DuplicateFlagError, add_flag


def test_every_option_string_and_dest_is_defined_once():
    parser = build_parser()
    seen_options, seen_dests = {}, {}
    for action in parser._actions:
        for option in action.option_strings:
            assert option not in seen_options, f"{option} defined twice"
            seen_options[option] = action
        if action.dest != "help":
            assert action.dest not in seen_dests, (
                f"{action.option_strings} and {seen_dests[action.dest].option_strings} share dest {action.dest}"
            )
            seen_dests[action.dest] = action


def test_a_second_rl_plugin_definition_raises():
    parser = argparse.ArgumentParser()
    add_flag(parser.add_argument_group("megatron"), "--calculate-per-token-loss", action="store_true")
    with pytest.raises(
        DuplicateFlagError,
        match=r"--calculate-per-token-loss is defined twice by rl_plugin: in the 'megatron' group and again in 'loss aggregation'",
    ):
        add_flag(parser.add_argument_group("loss aggregation"), "--calculate-per-token-loss", action="store_true")


def test_a_foreign_definition_is_read_not_redefined():
    """As Megatron-LM's extra_args_provider: its own flag stays, ours is skipped."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=42)
    add_flag(parser.add_argument_group("megatron"), "--seed", type=int, default=1234)
    assert parser.parse_args([]).seed == 42


# slime's spelling -> ours: the same dest and value
SLIME_ALIASES = [
    (["--n-samples-per-eval-prompt", "4"], ["--n-samples-per-eval", "4"], "n_samples_per_eval", 4),
    (["--check-weight-update-equal"], ["--check-weight-sync"], "check_weight_sync", True),
    (["--rm-type", "math"], ["--rm-type", "math_exact"], "rm_type", "math_exact"),
]


@pytest.mark.parametrize(
    "slime, ours, dest, value", SLIME_ALIASES, ids=[s[0][0] + "-" + s[0][-1] for s in SLIME_ALIASES]
)
def test_slime_spelling_sets_the_same_setting(slime, ours, dest, value):
    a, b = parse_args(slime), parse_args(ours)
    assert getattr(a, dest) == getattr(b, dest) == value
    assert vars(a) == vars(b)


@pytest.mark.parametrize("rm", ["deepscaler", "dapo", "f1", "gpqa", "ifbench", "random", "boxed_math"])
def test_slime_only_verifier_is_refused_with_the_port(rm, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--rm-type", rm])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --rm-type: '{rm}' is one of slime's verifiers" in err
    assert "Fix:" in err and "--custom-rm-path" in err and "math_exact" in err


def test_unknown_rm_type_is_left_to_choices(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rm-type", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


# Command lines that pass and that fail, across the modules' rules.
ORDER_CASES = [
    [],
    ["--calculate-per-token-loss"],
    ["--loss-aggregation", "token_mean"],
    ["--calculate-per-token-loss", "--loss-aggregation", "prompt_mean"],
    ["--calculate-per-token-loss", "--deepspeed-grad-scale"],
    ["--loss-aggregation", "prompt_mean", "--docs-per-step", "8"],
    ["--calculate-per-token-loss", "--docs-per-step", "8", "--n-samples-per-prompt", "4"],
    ["--loss-aggregation", "prompt_mean", "--global-batch-size", "6", "--n-samples-per-prompt", "4"],
    ["--loss-aggregation", "constant"],
    ["--eps-clip-high", "0.1"],
    ["--use-tis", "--use-rollout-logprobs"],
]


def _rules(run):
    """Every rule set: the ``check`` of each config instance in the run config's tree."""
    from rl_plugin.configs.run import configs_of

    return [(type(c).__name__, c.check) for c in configs_of(run) if hasattr(c, "check")]


def _outcome(run, rules):
    try:
        for _, rule in rules:
            rule(run)
    except RLArgumentError as exc:
        return "error", str(exc)
    return "ok", None


@pytest.mark.parametrize("argv", ORDER_CASES, ids=[" ".join(a) or "defaults" for a in ORDER_CASES])
def test_rules_do_not_write_args_and_do_not_depend_on_order(argv):
    from rl_plugin.configs.run import RunConfig

    args = build_parser().parse_args(argv)
    before_args = copy.deepcopy(vars(args))
    run = RunConfig.from_args(args, load_user_code=False)
    before = copy.deepcopy(run)
    rules = _rules(run)
    assert len(rules) >= 15, [name for name, _ in rules]  # every config with rules, LoRA and colocation too
    for name, rule in rules:  # a rule writes neither the tree (frozen) nor the namespace
        try:
            rule(run)
        except RLArgumentError:
            pass
        assert run == before and vars(args) == before_args, f"the rules of {name} wrote their input"
    forward, backward = _outcome(run, rules), _outcome(run, rules[::-1])
    assert forward[0] == backward[0]


def test_derived_setting_written_once_and_idempotent():
    from rl_plugin.arguments import validate_rl_args

    args = parse_args(["--calculate-per-token-loss"])
    assert (args.loss_aggregation, args.calculate_per_token_loss) == ("token_mean", True)
    again = validate_rl_args(copy.deepcopy(args))
    assert vars(again) == vars(args)
    args = parse_args(["--loss-aggregation", "token_mean"])
    assert args.calculate_per_token_loss is True
