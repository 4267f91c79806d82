"""What a custom rollout hook returned, checked before anything trains on it (fail loud).

For every returned sample (``rl_plugin.rollout.sample``'s contract):

- it is a ``Sample``;
- ``tokens`` is a list of ints, ``1 <= response_length <= len(tokens) - 1`` (a response of at
  least one token after at least one prompt token);
- ``loss_mask`` (None: every response token trained) and ``rollout_log_probs`` hold
  ``response_length`` entries each; the mask is 0/1 (an all-masked sample is valid: it counts in
  N and adds 0, as the loss core defines);
- its status is not ``ABORTED`` (a cut-off generation cannot be trained on);
- every id lies in ``[0, vocab_size)`` (one vectorised check over the whole rollout; the first
  offender is then located).

A failure raises ``SampleError`` naming the hook (flag, file:line), the sample (index, group,
prompt) and the rule. Checks over lengths are one pass of ``map`` over the samples, the id range
one numpy reduction over all tokens: no Python loop over tokens.
"""

from __future__ import annotations

from itertools import chain
from typing import List, Sequence

import numpy as np

from rl_plugin.rollout.sample import Sample


class SampleError(ValueError):
    """A hook returned a sample the trainer cannot train on; the message names hook, sample, rule."""


def _name(sample: Sample, i: int) -> str:
    prompt = sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt)
    short = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    return f"sample {i} (group {sample.group_index}, prompt {short!r})"


def check_samples(samples: Sequence, hook: str, vocab_size: int) -> List[Sample]:
    """``samples`` checked (module docstring); ``hook`` describes who returned them."""
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise SampleError(
                f"{hook} returned {type(s).__module__}.{type(s).__qualname__} for sample {i}; it must return the "
                "rl_plugin.rollout.Sample it was given (filled in)"
            )
    for i, s in enumerate(samples):
        _check_one(s, i, hook)
    n_tok = sum(map(len, (s.tokens for s in samples)))
    ids = np.fromiter(chain.from_iterable(s.tokens for s in samples), np.int64, n_tok)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        flat = int(np.nonzero((ids < 0) | (ids >= vocab_size))[0][0])
        ends = np.cumsum([len(s.tokens) for s in samples])
        i = int(np.searchsorted(ends, flat, side="right"))
        j = flat - (int(ends[i - 1]) if i else 0)
        raise SampleError(
            f"{hook}: {_name(samples[i], i)}: tokens[{j}] = {int(ids[flat])} is outside the model's vocabulary "
            f"[0, {vocab_size}); append ids of the run's tokenizer"
        )
    return list(samples)


def _check_one(s: Sample, i: int, hook: str) -> None:
    where = f"{hook}: {_name(s, i)}"
    if s.status == Sample.Status.ABORTED:
        raise SampleError(f"{where}: status ABORTED; an aborted generation cannot be trained on (retry it in the hook)")
    if not isinstance(s.tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in s.tokens):
        raise SampleError(
            f"{where}: tokens must be a list of ints (prompt ids + response ids), got {type(s.tokens).__name__}"
        )
    rl = s.response_length
    if isinstance(rl, bool) or not isinstance(rl, int) or not 1 <= rl <= len(s.tokens) - 1:
        raise SampleError(
            f"{where}: response_length = {rl!r} with {len(s.tokens)} tokens; it must count the response ids at the end of "
            "tokens (at least 1, leaving at least one prompt token)"
        )
    mask = s.loss_mask
    if mask is not None:
        if len(mask) != rl:
            raise SampleError(
                f"{where}: loss_mask has {len(mask)} entries for response_length {rl}; one per response token"
            )
        if not set(mask) <= {0, 1}:
            bad = next(m for m in mask if m not in (0, 1))
            raise SampleError(f"{where}: loss_mask holds {bad!r}; it must be 0 (conditioned on) or 1 (trained)")
    lps = s.rollout_log_probs
    if lps is None or len(lps) != rl:
        got = "None" if lps is None else f"{len(lps)} entries"
        raise SampleError(
            f"{where}: rollout_log_probs is {got} for response_length {rl}; it must hold one log-prob per response "
            "token (generate_tokens' output_log_probs for the model's tokens, 0.0 for the tokens the hook appended)"
        )
