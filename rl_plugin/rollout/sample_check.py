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

Degenerate rollouts (``check_distinct``, ``duplicate_groups``, ``check_trainable``):

- the same ``Sample`` object twice in a rollout (a hook returning one object for a whole group, a
  rollout function returning one group several times) is refused: its copies have advantage 0 and
  train nothing, or train one group k times; an ``id()`` pass over the list;
- groups whose token sequences are all equal to another group's are only counted
  (``rollout/duplicate_groups``, one warning line per run): a data file with a repeated prompt and a
  nearly deterministic policy makes them legitimately;
- a rollout with no trained token (every loss mask 0) is refused: it trains nothing while the
  optimizer's momentum still moves the weights.

Limits (``hold_to_limits``): a sample with more than ``--rollout-max-response-len`` MODEL tokens
(loss mask 1: the engine's generation budget; tool output the hook appended is conditioned on, not
generated, and the DAPO over-long penalty counts the same tokens) or more tokens in all than the
model's context (``max_position_embeddings``: every token is a position) is cut after the last
token that fits both, its status set to ``TRUNCATED`` (``finish_reason`` "length"), and counted
(``rollout/cut_to_response_len``, ``rollout/cut_to_context``). Cut, not refused: an agent's
turns have no view of the total, and a cut response is what an engine's length limit gives.

Behaviour log-probs (``check_log_probs``, on the flattened rollout, for an engine's samples as for a
hook's): NaN or inf anywhere (a masked NaN still poisons a mask-weighted sum), and > ``LOG_PROB_TOL``
on a trained token, are refused naming who produced them and the sample. ``LOG_PROB_TOL`` = 1e-4:
fp32 ``log_softmax`` of a near-certain token can come out a few ulps above 0 (|error| ~ 1e-7 x the
logits' magnitude, ~1e-5 for logits of 100); anything larger is no log-probability. Accepted
values are kept as they are (exp(1e-4) is a ratio error of 0.01%).
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter, is_not
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from rl_plugin.rollout.sample import Sample


class SampleError(ValueError):
    """A hook returned a sample the trainer cannot train on; the message names hook, sample, rule."""


def describe_sample(sample: Sample, i: int) -> str:
    """``sample i (group g, prompt '...')``, the prompt cut to 60 characters."""
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
        raise SampleError(f"{hook}: {describe_sample(samples[i], i)}: {rule}")

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


LOG_PROB_TOL = 1e-4  # the largest log-prob accepted above 0 (rounding; module docstring)
_TOKENS, _MASK = attrgetter("tokens"), attrgetter("loss_mask")
_SAID: set = set()


def check_distinct(samples: Sequence[Sample], hook: str, group_size: int) -> None:
    """The same ``Sample`` object twice is refused (module docstring)."""
    ids = list(map(id, samples))
    if len(set(ids)) == len(ids):
        return
    first: Dict[int, int] = {}
    for j, k in enumerate(ids):
        if k in first:
            i = first[k]
            gi, gj = i // max(group_size, 1), j // max(group_size, 1)
            where = f"group {gi}" if gi == gj else f"groups {gi} and {gj}: a whole group returned twice?"
            raise SampleError(
                f"{hook}: samples {i} and {j} ({where}) are the same Sample object; each sample must be its own object "
                "(copies of one sample have advantage 0 and train nothing, a repeated group trains one prompt twice). "
                "Fix: fill in the sample each call is given, or copy.deepcopy a sample before reusing it"
            )
        first[k] = j


def duplicate_groups(samples: Sequence[Sample], group_size: int) -> int:
    """How many groups repeat an earlier group's token sequences exactly (counted, module docstring)."""
    keys = list(map(hash, map(tuple, map(_TOKENS, samples))))
    n = max(group_size, 1)
    groups = [tuple(sorted(keys[g : g + n])) for g in range(0, len(keys), n)]
    return len(groups) - len(set(groups))


def say_once(key: str, line: str) -> None:
    """One warning line per run (process) for ``key``."""
    if key not in _SAID:
        _SAID.add(key)
        print(f"warning: {line} (said once per run)", flush=True)


def _model_tokens(samples: Sequence[Sample], rl: np.ndarray) -> np.ndarray:
    """Each sample's loss-mask sum (None: its response length), one ``reduceat`` over all masks
    (every response length >= 1: ``check_samples`` ran first)."""
    masks = list(map(_MASK, samples))
    if not any(map(is_not, masks, repeat(None))):
        return rl.copy()
    masks = [m if m is not None else repeat(1, r) for m, r in zip(masks, rl.tolist())]  # as ``flatten_samples``
    flat = np.fromiter(chain.from_iterable(masks), np.int64, int(rl.sum()))
    starts = np.concatenate(([0], np.cumsum(rl)[:-1]))
    return np.add.reduceat(flat, starts) if flat.size else np.zeros_like(rl)


def hold_to_limits(samples: Sequence[Sample], max_model_tokens: int, context_len: Optional[int]) -> Dict[str, float]:
    """Cut every sample past ``max_model_tokens`` model tokens or ``context_len`` tokens (module
    docstring), in place; returns the counts. Only the samples over a limit are looked at one by one."""
    n = len(samples)
    rl = np.fromiter((s.response_length for s in samples), np.int64, n)
    tl = np.fromiter(map(len, map(_TOKENS, samples)), np.int64, n)
    model = _model_tokens(samples, rl)
    over_len = model > max_model_tokens
    over_ctx = (tl > context_len) if context_len is not None else np.zeros(n, bool)
    for i in np.nonzero(over_len | over_ctx)[0].tolist():
        s, r = samples[i], int(rl[i])
        prompt = len(s.tokens) - r
        mask = np.ones(r, np.int64) if s.loss_mask is None else np.asarray(s.loss_mask, np.int64)
        keep = int(
            np.searchsorted(np.cumsum(mask), max_model_tokens, side="right")
        )  # tokens before the (L+1)-th model token
        if context_len is not None:
            keep = min(keep, int(context_len) - prompt)
        if keep < 1:
            raise SampleError(
                f"{describe_sample(s, i)}: its prompt holds {prompt} ids, the model's whole context ({context_len}); "
                "no response token fits. Fix: shorten the prompt (or the conversation the hook builds)"
            )
        s.tokens = list(s.tokens[: prompt + keep])
        s.response_length = keep
        s.loss_mask = None if s.loss_mask is None else list(s.loss_mask[:keep])
        s.rollout_log_probs = list(s.rollout_log_probs[:keep])
        if s.rollout_routed_experts is not None:
            s.rollout_routed_experts = s.rollout_routed_experts[: len(s.tokens) - 1]
        s.status = Sample.Status.TRUNCATED
        s.response = ""  # re-decoded from the kept ids (``GenerationSource._checked``)
    counts = {"rollout/cut_to_response_len": float(over_len.sum()), "rollout/cut_to_context": float(over_ctx.sum())}
    if over_len.any():
        say_once(
            "response_len",
            f"a sample held {int(model.max())} model tokens (loss mask 1), more than --rollout-max-response-len "
            f"{max_model_tokens}; such samples are cut to the limit and counted in rollout/cut_to_response_len",
        )
    if over_ctx.any():
        say_once(
            "context",
            f"a sample held {int(tl.max())} tokens, more than the model's context ({context_len}); such samples are "
            "cut to it and counted in rollout/cut_to_context",
        )
    return counts


def _locate(flat: int, lengths: torch.Tensor):
    """(sample, position) of flat index ``flat`` in samples of ``lengths`` concatenated."""
    ends = torch.cumsum(lengths, 0)
    i = int(torch.searchsorted(ends, torch.tensor(flat), right=True))
    return i, flat - (int(ends[i - 1]) if i else 0)


def check_log_probs(
    log_probs: torch.Tensor, loss_mask: torch.Tensor, response_lengths: torch.Tensor, samples: Sequence, who: str
) -> None:
    """Behaviour log-probs ``[sum R_i]`` finite and <= ``LOG_PROB_TOL`` on trained tokens (module
    docstring); one vectorised pass, the offender located only on failure."""
    bad = ~torch.isfinite(log_probs) | ((log_probs > LOG_PROB_TOL) & (loss_mask > 0))
    if not bool(bad.any()):
        return
    flat = int(torch.nonzero(bad)[0])
    i, j = _locate(flat, response_lengths)
    value = float(log_probs[flat])
    raise SampleError(
        f"{who}: {describe_sample(samples[i], i)}: rollout_log_probs[{j}] = {value!r}; a behaviour log-prob is the log "
        f"of a probability: finite and <= 0 (accepted up to +{LOG_PROB_TOL:g} for rounding), a NaN or inf poisons every "
        "loss term it enters. Fix: pass generate_tokens' output_log_probs for the model's tokens and 0.0 for the ones "
        "the hook appended (an engine's: check its dtype and logits)"
    )


def check_trainable(loss_mask: torch.Tensor, who: str, num_samples: int) -> None:
    """A rollout with no trained token is refused (module docstring)."""
    if loss_mask.numel() and float(loss_mask.sum()) > 0:
        return
    raise SampleError(
        f"{who}: all {num_samples} samples of the rollout have loss mask 0 on every response token, so the rollout trains "
        "nothing (loss 0, grad 0, while the optimizer's momentum still moves the weights). Fix: set loss_mask 1 on the "
        "tokens the model generated (generate_tokens' output_ids), 0 only on the ones the hook appended"
    )
