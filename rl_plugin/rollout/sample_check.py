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
    """``samples`` checked (module docstring); ``hook`` describes who returned them. Each rule is
    one pass over all samples (``map``, numpy); only a failed rule looks for the sample to name."""
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise SampleError(
                f"{hook} returned {type(s).__module__}.{type(s).__qualname__} for sample {i}; it must return the "
                "rl_plugin.rollout.Sample it was given (filled in)"
            )

    def fail(i: int, rule: str):
        raise SampleError(f"{hook}: {_name(samples[i], i)}: {rule}")

    n = len(samples)
    aborted = [i for i, s in enumerate(samples) if s.status == Sample.Status.ABORTED]
    if aborted:
        fail(aborted[0], "status ABORTED; an aborted generation cannot be trained on (retry it in the hook)")
    for i, s in enumerate(samples):
        if (
            not isinstance(s.tokens, list)
            or isinstance(s.response_length, bool)
            or not isinstance(s.response_length, int)
        ):
            fail(
                i,
                f"tokens must be a list of ids and response_length an int, got {type(s.tokens).__name__} and {s.response_length!r}",
            )
    tl = np.fromiter(map(len, (s.tokens for s in samples)), np.int64, n)
    rl = np.fromiter((s.response_length for s in samples), np.int64, n)
    bad = np.nonzero((rl < 1) | (rl > tl - 1))[0]
    if bad.size:
        i = int(bad[0])
        fail(
            i,
            f"response_length = {int(rl[i])} with {int(tl[i])} tokens; it must count the response ids at the end of tokens "
            "(at least 1, leaving at least one prompt token)",
        )
    ml = np.fromiter((rl[i] if s.loss_mask is None else len(s.loss_mask) for i, s in enumerate(samples)), np.int64, n)
    bad = np.nonzero(ml != rl)[0]
    if bad.size:
        i = int(bad[0])
        fail(i, f"loss_mask has {int(ml[i])} entries for response_length {int(rl[i])}; one per response token")
    ll = np.fromiter((-1 if s.rollout_log_probs is None else len(s.rollout_log_probs) for s in samples), np.int64, n)
    bad = np.nonzero(ll != rl)[0]
    if bad.size:
        i = int(bad[0])
        got = "None" if ll[i] < 0 else f"{int(ll[i])} entries"
        fail(
            i,
            f"rollout_log_probs is {got} for response_length {int(rl[i])}; it must hold one log-prob per response token "
            "(generate_tokens' output_log_probs for the model's tokens, 0.0 for the tokens the hook appended)",
        )
    masks = np.asarray(list(chain.from_iterable(s.loss_mask for s in samples if s.loss_mask is not None)))
    if masks.size and not np.isin(masks, (0, 1)).all():
        i = next(i for i, s in enumerate(samples) if s.loss_mask is not None and not np.isin(s.loss_mask, (0, 1)).all())
        value = next(m for m in samples[i].loss_mask if m not in (0, 1))
        fail(i, f"loss_mask holds {value!r}; it must be 0 (conditioned on) or 1 (trained)")
    ids = np.asarray(list(chain.from_iterable(s.tokens for s in samples)))
    if ids.size and ids.dtype.kind not in "iu":
        i = next(i for i, s in enumerate(samples) if np.asarray(s.tokens).dtype.kind not in "iu")
        fail(i, f"tokens must be ints (prompt ids + response ids), found {np.asarray(samples[i].tokens).dtype} values")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        flat = int(np.nonzero((ids < 0) | (ids >= vocab_size))[0][0])
        ends = np.cumsum(tl)
        i = int(np.searchsorted(ends, flat, side="right"))
        j = flat - (int(ends[i - 1]) if i else 0)
        fail(
            i,
            f"tokens[{j}] = {int(ids[flat])} is outside the model's vocabulary [0, {vocab_size}); append ids of the run's tokenizer",
        )
    return list(samples)
