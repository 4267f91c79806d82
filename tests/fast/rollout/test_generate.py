"""Custom generation (issue 27): slime's generate hook and rollout function on the real embedded
model and ``hf`` engine, ``generate_tokens``' batching, the loss mask from the hook to the step
batch, and the fail-loud checks of what a hook returns (``tests/support/turn_hooks.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.checkpoint.pending_rollout import PendingRollout, read_pending_rollout, write_pending_rollout
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.advantages import rollout_batch
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout import Sample, generate_tokens
from rl_plugin.rollout.dapo.filters import overlong_penalty
from rl_plugin.rollout.flatten import concat_rollouts
from rl_plugin.rollout.generate import sampling_params_of
from rl_plugin.rollout.generation.hooks import HookError
from rl_plugin.rollout.manager import RolloutManager
from rl_plugin.rollout.sample_check import SampleError
from tests.support.turn_hooks import TOOL_IDS

HOOKS = Path(__file__).resolve().parents[2] / "support" / "turn_hooks.py"


def _manager(tmp_path, *extra, hook="two_turn", flag="--custom-generate-function-path"):
    args = parse_train_flags(
        ["--n-samples-per-prompt", "4", "--rollout-batch-size", "4", "--output-dir", str(tmp_path / "out")]
        + ([flag, f"{HOOKS}:{hook}"] if hook else [])
        + list(extra)
    )
    prepare_embedded(args)
    m = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)
    calls = []
    generate = m.fleet.engine.generate

    def counted(prompts, params, **kw):  # the real engine; the calls counted
        calls.append(len(prompts))
        return generate(prompts, params, **kw)

    m.fleet.engine.generate = counted
    return m, calls


def _per_sample(t: torch.Tensor, lengths: torch.Tensor):
    return list(t.split(lengths.tolist()))


def test_two_turn_hook_batches_requests_and_masks_the_tool_turn(tmp_path):
    m, calls = _manager(tmp_path)
    data = m.generate(0)
    rl, tl = data.response_lengths, data.total_lengths
    masks = _per_sample(data.loss_mask, rl)
    tokens = _per_sample(data.tokens, tl)
    lps = _per_sample(data.rollout_log_probs, rl)
    two_turn = [i for i, mk in enumerate(masks) if (mk == 0).any()]
    assert two_turn, "some sample must have reached the tool turn"
    # one engine call per turn for all 16 samples: turn 1 (16 requests), turn 2 (the unfinished ones)
    assert calls == [16, len(two_turn)]
    for i in two_turn:
        response = tokens[i][-int(rl[i]) :]
        assert masks[i].tolist()[:4] == [1, 1, 0, 0] and masks[i][4:].eq(1).all()
        assert response[2:4].tolist() == TOOL_IDS  # token in, token out: the appended ids, where the hook put them
        assert lps[i][2:4].tolist() == [0.0, 0.0] and (lps[i][:2] < 0).all()
    assert data.stats["multi_turn/model_tokens"] == float(data.loss_mask.sum())
    frac = 1 - float(data.loss_mask.sum()) / float(rl.sum())
    assert data.stats["multi_turn/masked_token_frac"] == pytest.approx(frac, abs=1e-12)
    assert data.stats["multi_turn/tool_calls_mean"] == len(two_turn) / 16
    assert data.stats["multi_turn/turns_mean"] == 1 + len(two_turn) / 16
    assert data.model_token_counts().tolist() == [int(mk.sum()) for mk in masks]
    batch = rollout_batch(data, "grpo")  # the trainer's batch carries the mask as it is
    assert torch.equal(batch.loss_mask, data.loss_mask) and torch.equal(batch.tokens, data.tokens)


def test_same_seed_same_tokens_and_the_rollout_function_form(tmp_path):
    a = _manager(tmp_path / "a")[0].generate(3)
    b = _manager(tmp_path / "b")[0].generate(3)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
    c, calls = _manager(tmp_path / "c", hook="rollout_fn", flag="--rollout-function-path")
    data = c.generate(3)
    assert data.num_groups == 4 and data.group_ids.tolist() == [g for g in range(4) for _ in range(4)]
    assert (data.loss_mask == 0).any() and calls[0] == 16


def test_plain_def_rollout_function_and_a_short_rollout(tmp_path):
    async_form = _manager(tmp_path / "a", hook="rollout_fn", flag="--rollout-function-path")[0].generate(2)
    m, calls = _manager(tmp_path / "s", hook="rollout_fn_sync", flag="--rollout-function-path")
    sync_form = m.generate(2)
    assert torch.equal(sync_form.tokens, async_form.tokens) and calls[0] == 16
    short = _manager(tmp_path / "x", hook="rollout_fn_short", flag="--rollout-function-path")[0]
    with pytest.raises(
        HookError,
        match=r"returned 3 groups of sizes \[4, 4, 4\] for rollout 0; the trainer needs --rollout-batch-size 4",
    ):
        short.generate(0)


def test_pending_rollout_and_group_selection_keep_the_mask(tmp_path):
    data = _manager(tmp_path)[0].generate(0)
    write_pending_rollout(tmp_path, PendingRollout(1, data, 1))
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "pending_rollout.pt").write_bytes((tmp_path / "pending_rollout.pt").read_bytes())
    back = read_pending_rollout(tmp_path, 2).data
    assert torch.equal(back.loss_mask, data.loss_mask)
    part = data.select_groups(torch.tensor([2, 0]), 4)
    both = concat_rollouts([part, data.select_groups(torch.tensor([1]), 4)], 4)
    want = torch.cat(
        [_per_sample(data.loss_mask, data.response_lengths)[i] for i in [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]]
    )
    assert torch.equal(both.loss_mask, want)


def test_overlong_shaping_counts_model_tokens(tmp_path):
    m, _ = _manager(tmp_path, "--overlong-buffer-len", "2", "--rollout-max-response-len", "4")
    data = m.generate(0)
    model = data.model_token_counts()
    want = overlong_penalty(model, max_len=4, buffer_len=2, factor=1.0)
    assert data.stats["overlong/penalty_mean"] == pytest.approx(float(want.mean()))
    assert data.stats["reward_shaped_mean"] == pytest.approx(data.stats["reward_mean"] + float(want.mean()))
    assert (data.response_lengths > model).any()  # the tool ids would have been counted by length
    assert float(overlong_penalty(torch.tensor([9]), max_len=4, buffer_len=2, factor=1.0)) == -1.0  # capped at -f


def test_dynamic_sampling_runs_rounds_through_the_hook(tmp_path):
    m, calls = _manager(
        tmp_path,
        "--dynamic-sampling-filter-path",
        f"{HOOKS}:every_other_group",
        "--custom-rm-path",
        f"{HOOKS}:first_digit_reward",
        "--over-sampling-batch-size",
        "4",
    )
    data = m.generate(0)
    assert data.num_groups == 4 and data.stats["dynamic_sampling/rounds"] >= 2, data.stats
    assert len(calls) >= 2 * data.stats["dynamic_sampling/rounds"] - 1  # every round through the hook's turns
    masks = _per_sample(data.loss_mask, data.response_lengths)
    assert data.stats["multi_turn/model_tokens"] == float(data.loss_mask.sum())
    assert all(mk.tolist()[:4] == [1, 1, 0, 0] for mk in masks if (mk == 0).any())
    assert data.stats["dynamic_sampling/groups_generated"] == 8 and data.stats["dynamic_sampling/groups_kept"] == 4


@pytest.mark.parametrize(
    "hook, words",
    [
        ("bad_mask", ["loss_mask has", "for response_length", "sample 0 (group 0"]),
        ("out_of_vocab", ["tokens[", "10000", "vocabulary [0, 16)"]),
        ("not_a_sample", ["returned builtins.dict for sample 0"]),
        ("float_token", ["tokens must be ints", "float64"]),
        ("mask_value_two", ["loss_mask holds 2"]),
        ("no_log_probs", ["rollout_log_probs is None for response_length 1"]),
        ("aborted", ["status ABORTED"]),
    ],
)
def test_bad_hook_output_names_hook_and_sample(tmp_path, hook, words):
    m, _ = _manager(tmp_path, hook=hook)
    with pytest.raises(SampleError) as err:
        m.generate(0)
    msg = str(err.value)
    assert f"--custom-generate-function-path {HOOKS}:{hook}" in msg and "turn_hooks.py:" in msg
    for w in words:
        assert w in msg, (w, msg)


def test_hook_exception_names_file_line_and_sample(tmp_path):
    m, _ = _manager(tmp_path, hook="raises")
    with pytest.raises(
        HookError, match=r"raised on sample 0 \(group 0\): KeyError: 'no such tool' at .*turn_hooks.py:\d+"
    ):
        m.generate(0)


def test_generate_tokens_outside_a_rollout_and_bad_sampling_params():
    with pytest.raises(RuntimeError, match="runs inside a rollout"):
        asyncio.run(generate_tokens(None, [1, 2], {"max_new_tokens": 2}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_tokens'\]"):
        sampling_params_of({"max_tokens": 3})
    with pytest.raises(ValueError, match="stop strings are not supported"):
        sampling_params_of({"max_new_tokens": 3, "stop": ["</calc>"]})
    p = sampling_params_of({"max_new_tokens": 3, "stop_token_ids": [7, 5], "skip_special_tokens": True})
    assert (p.max_new_tokens, p.stop_token_ids, p.top_k) == (3, (5, 7), -1)
    assert Sample().status == Sample.Status.PENDING
