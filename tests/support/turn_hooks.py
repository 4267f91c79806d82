"""Custom generate hooks for the tests (user code, loaded by --custom-generate-function-path).

``two_turn`` on the embedded digit model (char ids: <pad> 0, <bos> 1, <eos> 2, <sep> 3, digit d
= 4 + d): turn 1 samples up to 2 ids; unless it ended on <eos>, a "tool" appends ``TOOL_IDS``
(<sep> 7, loss mask 0, log-prob 0.0) and turn 2 samples up to 2 ids more. Token in, token out:
``sample.tokens`` = prompt + turn 1 + tool + turn 2 exactly as generated.
"""

from __future__ import annotations

from rl_plugin.rollout import Sample, generate_tokens

TOOL_IDS = [3, 11]  # "<sep>7"


async def two_turn(args, sample: Sample, sampling_params) -> Sample:
    first = await generate_tokens(args, sample.tokens, dict(sampling_params, max_new_tokens=2))
    ids, mask, lps = list(first["output_ids"]), [1] * len(first["output_ids"]), list(first["output_log_probs"])
    finish, turns, calls = first["finish_reason"], 1, 0
    if finish == "length":
        ids += TOOL_IDS
        mask += [0] * len(TOOL_IDS)
        lps += [0.0] * len(TOOL_IDS)
        second = await generate_tokens(args, sample.tokens + ids, dict(sampling_params, max_new_tokens=2))
        ids += second["output_ids"]
        mask += [1] * len(second["output_ids"])
        lps += second["output_log_probs"]
        finish, turns, calls = second["finish_reason"], 2, 1
    sample.tokens = sample.tokens + ids
    sample.response_length = len(ids)
    sample.loss_mask, sample.rollout_log_probs = mask, lps
    sample.status = Sample.Status.COMPLETED if finish == "stop" else Sample.Status.TRUNCATED
    sample.metadata.update(turns=turns, tool_calls=calls)
    return sample


async def bad_mask(args, sample: Sample, sampling_params) -> Sample:
    out = await generate_tokens(args, sample.tokens, sampling_params)
    sample.tokens = sample.tokens + out["output_ids"]
    sample.response_length = len(out["output_ids"])
    sample.rollout_log_probs = out["output_log_probs"]
    sample.loss_mask = [1] * (sample.response_length + 1)  # one too many
    return sample


async def out_of_vocab(args, sample: Sample, sampling_params) -> Sample:
    sample.tokens = sample.tokens + [10_000]
    sample.response_length, sample.loss_mask, sample.rollout_log_probs = 1, [1], [0.0]
    return sample


async def not_a_sample(args, sample: Sample, sampling_params):
    return {"tokens": sample.tokens}


async def raises(args, sample: Sample, sampling_params):
    raise KeyError("no such tool")


async def rollout_fn(args, rollout_id, data_source, evaluation=False):
    """slime's whole-rollout form: every group of the rollout through ``two_turn``."""
    import asyncio

    groups = data_source.get_samples(args.rollout_batch_size)
    params = {"max_new_tokens": args.rollout_max_response_len}
    await asyncio.gather(*(two_turn(args, s, params) for g in groups for s in g))
    return groups


def first_digit_reward(prompt, response, label) -> float:
    """A reward that varies within a group (so every step has a gradient): the response's first
    digit / 9 (0 without one)."""
    return int(response[0]) / 9 if response[:1].isdigit() else 0.0


_seen = [0]


def every_other_group(args, samples) -> bool:
    """A dynamic-sampling filter that keeps every other group it is asked about (so a rollout
    needs two rounds)."""
    _seen[0] += 1
    return _seen[0] % 2 == 0


async def _one_token(sample: Sample, token=5, mask=(1,), lps=(0.0,)) -> Sample:
    sample.tokens = sample.tokens + [token]
    sample.response_length = 1
    sample.loss_mask = None if mask is None else list(mask)
    sample.rollout_log_probs = None if lps is None else list(lps)
    return sample


async def float_token(args, sample, sampling_params):
    return await _one_token(sample, token=5.0)


async def mask_value_two(args, sample, sampling_params):
    return await _one_token(sample, mask=(2,))


async def no_log_probs(args, sample, sampling_params):
    return await _one_token(sample, lps=None)


async def aborted(args, sample, sampling_params):
    sample = await _one_token(sample)
    sample.status = Sample.Status.ABORTED
    return sample


def rollout_fn_sync(args, rollout_id, data_source, evaluation=False):
    """The same as a plain ``def``: it runs its own event loop (``generate_tokens`` still batches)."""
    import asyncio

    return asyncio.run(rollout_fn(args, rollout_id, data_source, evaluation))


def rollout_fn_short(args, rollout_id, data_source, evaluation=False):
    """Returns one group too few (the trainer needs --rollout-batch-size groups)."""
    return data_source.get_samples(args.rollout_batch_size - 1)
