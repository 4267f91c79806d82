"""Issue 28, items 5 and 6: dynamic-sampling filters and labels that used to train silently wrong.

- A filter's result was coerced with ``bool()``: None (a missing ``return``) rejected every group
  and burned 64 silent rounds, any string kept every group, a bool tensor failed without naming
  the filter. Now anything but a bool (``numpy.bool_`` accepted) stops the rollout at the first
  call, naming the flag, the function's file:line, the value and its type.
- ``--dynamic-sampling-max-rounds`` (was the constant 64), with one progress line per round after
  the first; ``--dynamic-sampling-filter-path file.py:fn`` accepted like ``--custom-rm-path``.
- Null labels with a built-in verifier trained with reward 0; a float label 7.0 became "7.0", so
  ``digit_match`` scored a correct "7" as 1/3. Now null/empty labels are refused at preflight
  (file:line) and numeric labels are compared as numbers.

The filter cases run the real rollout manager (the embedded tiny model, real generate)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.rollout.dapo.filters import FilterResultError, GroupFilter, keep_decision, load_filter
from rl_plugin.rollout.data.dataset import read_jsonl
from rl_plugin.rollout.data.prompt_check import check_labels
from rl_plugin.rollout.rewards.functions import load_reward_fn
from rl_plugin.rollout.sample import Sample
from tests.support.flag_rules import assert_refused

GROUP = [Sample(prompt="12=", response="12", label="12", reward=r, response_length=2) for r in (1.0, 0.5)]


def _filter_file(tmp_path: Path, body: str, name: str = "filt") -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(f"import torch\nimport numpy as np\n\n\ndef keep(args, samples, **kw):\n{body}\n")
    return path


# --- item 5: what a filter may return ---------------------------------------------------------


@pytest.mark.parametrize(
    "body,shown,fix",
    [
        ("    rewards = [s.reward for s in samples]", "returned None of type builtins.NoneType", "without `return`"),
        ("    return 'no'", "returned 'no' of type builtins.str", "bool('no') is True"),
        ("    return len(samples)", "returned 2 of type builtins.int", "return True or False"),
        ("    return torch.tensor(True)", "returned tensor(True) of type torch.Tensor", "(...).item()"),
        ("    return torch.tensor([True, False])", "torch.Tensor", "reduce it to one decision"),
    ],
    ids=["none", "str", "int", "bool-tensor-0d", "bool-tensor-1d"],
)
def test_filter_result_that_is_not_a_bool_fails_at_the_first_call(tmp_path, body, shown, fix):
    path = _filter_file(tmp_path, body)
    spec = f"{path}:keep"
    parse_args(["--dynamic-sampling-filter-path", spec])  # the file.py:fn form is accepted at parse time
    filt = load_filter(spec)
    with pytest.raises(FilterResultError) as err:
        filt.keep(None, GROUP)
    msg = str(err.value)
    for fragment in (f"--dynamic-sampling-filter-path {spec}", f"function keep at {path}:5", shown, fix, "Fix:"):
        assert fragment in msg, msg
    assert "\n" not in msg  # one line: the driver shows the remote error line


def test_filter_results_accepted_as_bools(tmp_path):
    class Out:  # slime's DynamicFilterOutput
        def __init__(self, keep):
            self.keep = keep

    for value, want in ((True, True), (False, False), (np.bool_(True), True), (np.float64(1.0) > 0, True)):
        got = keep_decision(value)
        assert got is want and type(got) is bool
    assert keep_decision(Out(False)) is False and keep_decision(Out(np.bool_(True))) is True
    with pytest.raises(FilterResultError, match=r"returned None of type builtins.NoneType \(.keep of a Out\)"):
        keep_decision(Out(None))
    path = _filter_file(tmp_path, "    return np.std([s.reward for s in samples]) > 0")
    assert load_filter(f"{path}:keep").keep(None, GROUP) is True


def test_filter_forms_are_those_of_custom_rm_path(tmp_path):
    path = _filter_file(tmp_path, "    return True")
    for spec in (
        f"{path}:keep",
        "rl_plugin.rollout.dapo.filters:check_reward_nonzero_std",
        "rl_plugin.rollout.dapo.filters.check_reward_nonzero_std",
    ):
        assert isinstance(load_filter(spec), GroupFilter)
        parse_args(["--dynamic-sampling-filter-path", spec])
    bad = tmp_path / "bad.py"
    bad.write_text("def keep(args, samples)\n    return True\n")
    assert_refused(f"--dynamic-sampling-filter-path {bad}:keep", [f"{bad}:1", "SyntaxError", "failed to import"])
    assert_refused(
        f"--dynamic-sampling-filter-path {tmp_path}/none.py:keep", ["cannot load the function", "no such file"]
    )
    assert_refused(f"--dynamic-sampling-filter-path {path}:nope", ["has no callable 'nope'"])


@pytest.mark.parametrize(
    "flags,fragments",
    [
        ("--dynamic-sampling-max-rounds 8", ["--dynamic-sampling-max-rounds without --dynamic-sampling-filter-path"]),
        (
            "--dynamic-sampling-filter-path rl_plugin.rollout.dapo.filters.check_reward_nonzero_std --dynamic-sampling-max-rounds 0",
            ["--dynamic-sampling-max-rounds: must be >= 1 (got 0)"],
        ),
    ],
)
def test_max_rounds_flag_rules(flags, fragments):
    assert_refused(flags, fragments)


def _manager(tmp_path, monkeypatch, spec: str, *extra: str):
    from rl_plugin.configs import RolloutConfig
    from rl_plugin.loop.embedded_setup import prepare_embedded
    from rl_plugin.rollout.manager import RolloutManager
    from rl_plugin.train import parse_train_args

    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path / "cache"))
    args = parse_train_args(
        [
            "--n-samples-per-prompt",
            "2",
            "--rollout-batch-size",
            "2",
            "--output-dir",
            str(tmp_path / "out"),
            "--dynamic-sampling-filter-path",
            spec,
            *extra,
        ]
    )
    prepare_embedded(args)
    cfg = RolloutConfig.from_args(args)
    return RolloutManager(cfg, args.hf_checkpoint, args.prompt_data, None), cfg


def test_missing_return_stops_the_real_rollout_in_its_first_round(tmp_path, monkeypatch, capsys):
    """Was: bool(None) is False, so every group was rejected for 64 silent rounds."""
    calls = tmp_path / "calls"
    path = _filter_file(tmp_path, f"    open({str(calls)!r}, 'a').write('x')")
    manager, _ = _manager(tmp_path, monkeypatch, f"{path}:keep")
    with pytest.raises(FilterResultError, match=rf"{path}:keep \(function keep at {path}:5\) returned None"):
        manager.generate(0)
    assert calls.read_text() == "x"  # the first group's call, nothing after it
    assert "round 2" not in capsys.readouterr().out


def test_max_rounds_and_one_progress_line_per_round(tmp_path, monkeypatch, capsys):
    path = _filter_file(tmp_path, "    return False")
    manager, cfg = _manager(tmp_path, monkeypatch, f"{path}:keep", "--dynamic-sampling-max-rounds", "3")
    assert cfg.dynamic_sampling_max_rounds == 3
    with pytest.raises(
        RuntimeError, match=r"only 0 of 6 prompt groups passed in 3 rounds \(--dynamic-sampling-max-rounds\)"
    ):
        manager.generate(0)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dynamic sampling")]
    assert lines == [
        "dynamic sampling, rollout 0: round 2/3: 0/4 groups passed the filter so far, kept 0/2",
        "dynamic sampling, rollout 0: round 3/3: 0/6 groups passed the filter so far, kept 0/2",
    ]


# --- item 6: labels ------------------------------------------------------------------------------


def _jsonl(tmp_path: Path, labels) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "label": lab}) + "\n" for i, lab in enumerate(labels)))
    return path


@pytest.mark.parametrize(
    "labels,fragments",
    [
        ([None] * 5, [":1", "is null", "5 of 5 labels, at lines 1, 2, 3, ..."]),
        (["12", None, 7], [":2", "is null", "1 of 3 labels, at lines 2"]),
        (["12", "  "], [":2", "is an empty string"]),
        ([["7"]], [":1", "is a JSON list (['7'])"]),
        ([True], [":1", "is a JSON bool (True)"]),
    ],
    ids=["all-null", "one-null", "empty", "list", "bool"],
)
def test_labels_a_builtin_verifier_cannot_score_are_refused_at_file_line(tmp_path, labels, fragments):
    path = _jsonl(tmp_path, labels)
    records = read_jsonl(path, "prompt", "label")
    for rm in ("digit_match", "math_exact"):
        with pytest.raises(RLArgumentError) as err:
            check_labels("--prompt-data", path, records, rm_type=rm, label_key="label")
        msg = str(err.value)
        assert f"--prompt-data {path}" in msg and f"--rm-type {rm}" in msg and "Fix:" in msg, msg
        for fragment in fragments:
            assert fragment in msg, msg
    check_labels("--prompt-data", path, records, rm_type=None, label_key="label")  # a custom reward takes any label
    ok = _jsonl(tmp_path, ["12", 7, 7.5, "x"])
    check_labels("--prompt-data", ok, read_jsonl(ok, "prompt", "label"), rm_type="math_exact", label_key="label")


def test_no_label_key_with_a_builtin_verifier_is_refused(tmp_path):
    path = _jsonl(tmp_path, ["1"])
    with pytest.raises(RLArgumentError, match="--label-key '' with --rm-type digit_match"):
        check_labels("--prompt-data", path, read_jsonl(path, "prompt", None), rm_type="digit_match", label_key="")


def test_null_labels_refused_by_the_trainer_before_ray(tmp_path, monkeypatch, capsys):
    """The real entry point, Ray forbidden: the check runs in preflight."""
    import ray

    from rl_plugin.loop.embedded_setup import ensure_tiny_model
    from rl_plugin.train import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("the label check must run before Ray starts"))
    model = str(ensure_tiny_model(tmp_path / "cache"))
    path = _jsonl(tmp_path, ["12", None, None])
    argv = ["--train-backend", "fsdp", "--no-progress-bar", "--num-rollout", "1", "--hf-checkpoint", model]
    argv += ["--rollout-batch-size", "1", "--rollout-max-response-len", "4", "--rm-type", "digit_match"]
    assert main([*argv, "--prompt-data", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--prompt-data {path}:2: the label ('label', --label-key) is null" in err, err


def test_numeric_labels_are_compared_as_numbers():
    digit, math_exact = load_reward_fn("digit_match"), load_reward_fn("math_exact")
    assert digit("7=", "7", 7.0) == 1.0  # was 1/3: the label became "7.0"
    assert digit("7=", "7", 7) == 1.0 and digit("7=", "7.0", 7) == 1.0
    assert digit("75=", "71", 75.0) == 0.5  # partial credit against "75"
    assert digit("413=", "413", "413") == 1.0 and digit("413=", "41", "413") == pytest.approx(
        2 / 3
    )  # strings unchanged
    assert math_exact("q", "so \\boxed{7.50}", 7.5) == 1.0  # was 0: "7.50" != "7.5"
    assert math_exact("q", "it is 1/2", 0.5) == 1.0 and math_exact("q", "0.1", 0.1) == 1.0
    assert math_exact("q", "\\boxed{1,000}", 1000) == 1.0 and math_exact("q", "\\boxed{7}", 7.0) == 1.0
    assert math_exact("q", "8", 7.0) == 0.0 and math_exact("q", "no number", 7) == 0.0
    assert math_exact("q", "7.0000000000000001", 7) == 0.0  # an int label is compared exactly
    assert math_exact("q", "\\boxed{x+1}", "x+1") == 1.0  # string labels: as before


def test_filter_sees_tensor_rewards_of_real_groups():
    """The built-in filter returns a Python bool (not a 0-dim tensor)."""
    from rl_plugin.rollout.dapo.filters import check_reward_nonzero_std

    assert check_reward_nonzero_std(None, GROUP) is True
    same = [Sample(prompt="p", response="r", label="l", reward=0.5, response_length=1)] * 2
    assert check_reward_nonzero_std(None, same) is False and not torch.is_tensor(check_reward_nonzero_std(None, same))
