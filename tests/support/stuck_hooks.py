"""User code that never returns from the third rollout on (16 samples a rollout in the tests that
use it: ``tests/fast/cli/test_exit_signals_stuck.py``): a generate hook awaiting a tool that never
answers, and a blocking ``rm(args, sample)`` judge that never answers."""

import asyncio
import time

from rl_plugin.rollout import generate_tokens

CALLS = {"generate": 0, "rm": 0}
AFTER = 32  # two rollouts of 4 prompts x 4 samples go through


async def stuck_generate(args, sample, sampling_params):
    CALLS["generate"] += 1
    if CALLS["generate"] > AFTER:
        await asyncio.Event().wait()  # a tool call that never answers
    out = await generate_tokens(args, sample.tokens, sampling_params)
    sample.tokens = sample.tokens + list(out["output_ids"])
    sample.response_length = len(out["output_ids"])
    sample.rollout_log_probs = list(out["output_log_probs"])
    sample.loss_mask = [1] * sample.response_length
    return sample


def stuck_rm(args, sample):
    CALLS["rm"] += 1
    if CALLS["rm"] > AFTER:
        time.sleep(10**6)  # a judge that never answers, blocking: no Python code can interrupt it
    return float(sample.response.strip() == str(sample.label))
