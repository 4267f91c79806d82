"""Issue 38: user hooks held to deadlines and limits, degenerate rollouts and bad behaviour
log-probs refused, on the real embedded model and ``hf`` engine (vocab 16, context 64: char ids
<pad> 0, <bos> 1, <eos> 2, <sep> 3, digit d = 4 + d). Each test reproduces a case of the issue
that the code before it trained on silently, froze on, or crashed on with a traceback."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout import Sample
from rl_plugin.rollout.generation.hooks import HookError
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.rollout.sample_check import SampleError

HOOKS = """
import asyncio, copy, math, time
from rl_plugin.rollout import Sample, generate_tokens

async def _fill(sample, ids, mask, lps):
    sample.tokens = sample.tokens + list(ids)
    sample.response_length = len(ids)
    sample.loss_mask, sample.rollout_log_probs = list(mask), list(lps)
    sample.status = Sample.Status.COMPLETED
    return sample

async def stuck(args, sample, sampling_params):
    if sample.index == 5:
        await asyncio.sleep(3600)  # a tool that never answers
    return await _fill(sample, [5], [1], [-0.5])

def stuck_sync(args, sample, sampling_params):
    if sample.index == 2:
        time.sleep(20)  # a plain def that blocks (left behind in its thread)
    sample.tokens = sample.tokens + [5]
    sample.response_length, sample.loss_mask, sample.rollout_log_probs = 1, [1], [-0.5]
    return sample

async def own_timeout(args, sample, sampling_params):
    raise TimeoutError("the tool timed out")

def own_timeout_sync(args, sample, sampling_params):
    raise TimeoutError("the tool timed out")

async def stuck_rollout(args, rollout_id, data_source, evaluation=False):
    data_source.get_samples(args.rollout_batch_size)
    await asyncio.sleep(3600)

def stuck_rollout_sync(args, rollout_id, data_source, evaluation=False):
    time.sleep(20)

async def appends_200(args, sample, sampling_params):  # the issue's hook: 200 model ids
    return await _fill(sample, [5] * 200, [1] * 200, [-0.1] * 200)

async def tool_200(args, sample, sampling_params):  # 2 model ids, then 200 tool ids (mask 0)
    return await _fill(sample, [6, 7] + [5] * 200, [1, 1] + [0] * 200, [-0.1, -0.1] + [0.0] * 200)

async def asks_500(args, sample, sampling_params):
    out = await generate_tokens(args, sample.tokens, dict(sampling_params, max_new_tokens=500))
    near = await generate_tokens(args, [4] * 60, dict(sampling_params, max_new_tokens=500))
    sample.metadata["lens"] = (len(out["output_ids"]), len(near["output_ids"]), near["finish_reason"])
    return await _fill(sample, out["output_ids"], [1] * len(out["output_ids"]), out["output_log_probs"])

async def fills_context(args, sample, sampling_params):
    await generate_tokens(args, [4] * 64, sampling_params)

_kept = {}

async def one_object(args, sample, sampling_params):  # one Sample for the whole group
    first = _kept.setdefault(sample.group_index, sample)
    if first is sample:
        await _fill(sample, [5], [1], [-0.5])
    return first

async def one_group_4_times(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size)
    for s in groups[0]:
        await _fill(s, [5], [1], [-0.5])
    return [groups[0]] * len(groups)

async def copied_groups(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size)
    for s in groups[0]:
        await _fill(s, [5, 6], [1, 1], [-0.5, -0.5])
    return [groups[0]] + [copy.deepcopy(groups[0]) for _ in groups[1:]]

async def all_masked(args, sample, sampling_params):
    return await _fill(sample, [5, 6], [0, 0], [0.0, 0.0])

async def nan_log_prob(args, sample, sampling_params):
    return await _fill(sample, [5, 6], [1, 1], [-0.5, math.nan if sample.index == 3 else -0.5])

async def positive_log_prob(args, sample, sampling_params):
    return await _fill(sample, [5], [1], [0.5 if sample.index == 6 else -0.5])

async def rounding_log_prob(args, sample, sampling_params):
    return await _fill(sample, [5], [1], [1e-7])
async def oov_id(args, sample, sampling_params):  # an id past the embedded vocabulary (16)
    out = await generate_tokens(args, sample.tokens + [16], sampling_params)
    return await _fill(sample, out["output_ids"], [1] * len(out["output_ids"]), out["output_log_probs"])
"""


@pytest.fixture
def hooks(tmp_path) -> Path:
    p = tmp_path / "hooks.py"
    p.write_text(HOOKS)
    return p


def _manager(tmp_path, hooks: Path, name: str, *extra, flag="--custom-generate-function-path"):
    args = parse_train_flags(
        ["--n-samples-per-prompt", "4", "--rollout-batch-size", "2", "--output-dir", str(tmp_path / "out")]
        + [flag, f"{hooks}:{name}"]
        + list(extra)
    )
    prepare_embedded(args)
    return RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)


# -- item 3: deadlines --------------------------------------------------------------------------


@pytest.mark.parametrize("name, sample", [("stuck", 5), ("stuck_sync", 2)])
def test_a_stuck_generate_hook_stops_at_its_deadline_naming_the_sample(tmp_path, hooks, name, sample):
    m = _manager(tmp_path, hooks, name, "--custom-generate-timeout", "1")
    with pytest.raises(HookError) as err:
        m.generate(0)
    msg = str(err.value)
    assert f"--custom-generate-function-path {hooks}:{name} ({name} at {hooks}:" in msg, msg
    assert (
        f"did not return within --custom-generate-timeout 1 s on sample {sample} (group {sample // 4}, prompt '" in msg
    )
    assert "Fix: give the hook's tools" in msg


@pytest.mark.parametrize("name", ["own_timeout", "own_timeout_sync"])
def test_a_hooks_own_timeout_error_is_its_error_not_the_deadline(tmp_path, hooks, name):
    m = _manager(tmp_path, hooks, name)
    with pytest.raises(
        HookError, match=r"raised on sample \d+ \(group \d+\): TimeoutError: the tool timed out at .*hooks.py"
    ):
        m.generate(0)


@pytest.mark.parametrize("name", ["stuck_rollout", "stuck_rollout_sync"])
def test_a_stuck_rollout_function_stops_at_its_deadline(tmp_path, hooks, name):
    m = _manager(tmp_path, hooks, name, "--rollout-function-timeout", "1", flag="--rollout-function-path")
    with pytest.raises(
        HookError,
        match=rf"{name} at .*hooks.py:\d+\) did not return within --rollout-function-timeout 1 s on rollout 0",
    ):
        m.generate(0)


def test_an_id_past_the_vocabulary_is_named_before_the_engine_sees_it(tmp_path, hooks):
    """Issue 44 item 9: generate_tokens checked only ids < 0; id 16 of the 16-id vocabulary
    reached the engine (an IndexError from the embedding on CPU, a device-side assert on a GPU)."""
    m = _manager(tmp_path, hooks, "oov_id")
    with pytest.raises(
        HookError,
        match=r"oov_id at .*raised on sample 0 \(group 0\): ValueError: generate_tokens: "
        r"input_ids\[\d+\] = 16 is outside the model's vocabulary \[0, 16\)",
    ):
        m.generate(0)


def test_deadline_flags_must_be_positive():
    from rl_plugin.errors import RLArgumentError

    for flag, hook in (
        ("--custom-generate-timeout", "--custom-generate-function-path"),
        ("--rollout-function-timeout", "--rollout-function-path"),
    ):
        with pytest.raises(RLArgumentError, match=rf"{flag}: must be a positive number of seconds \(got 0.0\)"):
            parse_train_flags([hook, "m:f", flag, "0"])


# -- item 4: limits -----------------------------------------------------------------------------


def test_model_tokens_past_the_response_len_are_cut_and_counted(tmp_path, hooks, capsys):
    m = _manager(tmp_path, hooks, "appends_200", "--rollout-max-response-len", "4")
    data = m.generate(0)
    assert data.response_lengths.tolist() == [4] * 8  # was 200 each (past the flag and the 64 positions)
    assert data.stats["rollout/cut_to_response_len"] == 8.0 and data.stats["rollout/cut_to_context"] == 8.0  # past both
    assert data.stats["truncated_frac"] == 1.0
    m.generate(1)
    out = capsys.readouterr().out
    assert out.count("more than --rollout-max-response-len 4") == 1, out  # one line per run


def test_tool_tokens_count_against_the_context_not_the_response_len(tmp_path, hooks):
    m = _manager(tmp_path, hooks, "tool_200", "--rollout-max-response-len", "4")
    data = m.generate(0)
    assert data.total_lengths.max().item() == 64  # the model's max_position_embeddings
    assert data.stats["rollout/cut_to_context"] == 8.0 and data.stats["rollout/cut_to_response_len"] == 0.0
    assert float(data.loss_mask.sum()) == 16.0  # the two model tokens of each sample kept


def test_generate_tokens_clamps_max_new_tokens_to_the_flag_and_the_context(tmp_path, hooks, capsys):
    m = _manager(tmp_path, hooks, "asks_500", "--rollout-max-response-len", "8")
    samples = m.generation.generate_samples(m.generation.prompts.next_batch(2), 4, 0)
    lens = [s.metadata["lens"] for s in samples]
    assert all(a <= 8 and b <= 4 for a, b, _ in lens), lens  # the hf engine generated 500 before
    assert any(b == 4 and f == "length" for _, b, f in lens), lens  # 60 ids + 4 = the 64 positions
    out = capsys.readouterr().out
    assert out.count("max_new_tokens=500 clamped to 8 (--rollout-max-response-len)") <= 1
    assert "clamped to 4 for input_ids of 60 ids (the model's context: max_position_embeddings 64)" in out


def test_input_ids_that_fill_the_context_are_refused(tmp_path, hooks):
    m = _manager(tmp_path, hooks, "fills_context")
    with pytest.raises(
        HookError, match=r"input_ids hold 64 ids, the model's whole context \(max_position_embeddings 64\)"
    ):
        m.generate(0)


# -- item 5: degenerate rollouts ------------------------------------------------------------------


def test_one_sample_object_for_a_whole_group_is_refused(tmp_path, hooks):
    m = _manager(tmp_path, hooks, "one_object")
    with pytest.raises(SampleError, match=r"one_object at .*samples 0 and 1 \(group 0\) are the same Sample object"):
        m.generate(0)


def test_a_rollout_function_returning_one_group_twice_is_refused(tmp_path, hooks):
    m = _manager(tmp_path, hooks, "one_group_4_times", flag="--rollout-function-path")
    with pytest.raises(SampleError, match=r"samples 0 and 4 \(groups 0 and 1: a whole group returned twice\?\)"):
        m.generate(0)


def test_copied_groups_are_counted_not_refused(tmp_path, hooks, capsys, monkeypatch):
    from rl_plugin.rollout import sample_check

    monkeypatch.setattr(sample_check, "_SAID", set())  # said once per process: an earlier test may have said it
    m = _manager(tmp_path, hooks, "copied_groups", flag="--rollout-function-path")
    data = m.generate(0)
    assert data.stats["rollout/duplicate_groups"] == 1.0
    assert "returned 1 group(s) whose samples repeat another group's tokens exactly" in capsys.readouterr().out


def test_a_rollout_with_no_trained_token_is_refused(tmp_path, hooks):
    m = _manager(tmp_path, hooks, "all_masked")
    with pytest.raises(SampleError, match=r"all_masked at .*all 8 samples of the rollout have loss mask 0"):
        m.generate(0)


# -- item 8: behaviour log-probs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, where",
    [
        ("nan_log_prob", r"sample 3 \(group 0, .*rollout_log_probs\[1\] = nan"),
        ("positive_log_prob", r"sample 6 \(group 1, .*rollout_log_probs\[0\] = 0.5"),
    ],
)
def test_bad_behaviour_log_probs_from_a_hook_are_refused_naming_it(tmp_path, hooks, name, where):
    m = _manager(tmp_path, hooks, name)
    with pytest.raises(
        SampleError, match=rf"--custom-generate-function-path {hooks}:{name} .*{where}.*finite and <= 0"
    ):
        m.generate(0)


def test_rounding_above_zero_is_accepted(tmp_path, hooks):
    data = _manager(tmp_path, hooks, "rounding_log_prob").generate(0)
    assert math.isclose(float(data.rollout_log_probs.max()), 1e-7, rel_tol=1e-3)


def test_nan_log_probs_from_the_engine_are_refused_naming_it(tmp_path):
    args = parse_train_flags(
        ["--n-samples-per-prompt", "2", "--rollout-batch-size", "2", "--output-dir", str(tmp_path / "o")]
    )
    prepare_embedded(args)
    m = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)
    generate = m.fleet.engine.generate

    def nan_engine(prompts, params, **kw):  # the real engine, one log-prob turned NaN
        gens = generate(prompts, params, **kw)
        gens[1].log_probs[0] = float("nan")
        return gens

    m.fleet.engine.generate = nan_engine
    with pytest.raises(SampleError, match=r"the hf engine: sample 1 \(group 0, .*rollout_log_probs\[0\] = nan"):
        m.generate(0)
    assert Sample().status == Sample.Status.PENDING
