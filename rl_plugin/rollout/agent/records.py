"""An agent session's completions as recorded, and the samples they become (token in, token out).

Every completion the endpoint serves is one ``TurnRecord``: the prompt ids the engine saw, the
ids it produced, their log-probs (one per output id, the engine's own) and the weight version
that produced them (None where the loop tracks none). ``appended`` is True when the turn's
prompt ids extend the previous record's prompt + output ids of the same session
(``sessions.Session.prompt_ids``): the agent kept the history and the template re-rendered none
of it.

``episode_samples``: a session's records, in the order they completed, cut into maximal
append-only runs; each run becomes ONE ``Sample``:

    tokens    = the run's last prompt ids + its last output ids
    prompt    = the run's first prompt ids
    loss_mask = 1 on every output id of every record of the run, 0 on everything else
                (what the agent or the template added between two completions: tool results,
                the next user turn, ``<|im_end|>\\n<|im_start|>assistant\\n``)
    rollout_log_probs = the engine's log-prob on a 1 position, 0.0 on a 0 position
    multimodal_inputs / multimodal_train_inputs = the last prompt's images (``images``)

so an append-only session is one sample whose trained tokens are exactly the completions, and a
session whose every turn rewrote the history (or a template that re-renders earlier turns, e.g.
one that strips earlier reasoning) is one sample per turn. Every turn whose prompt does not
extend the previous one is counted (``agent/non_append_turns``); the samples of one episode share
its reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from rl_plugin.rollout.sample import Sample


@dataclass
class TurnRecord:
    """One completion: ``prompt_ids`` (what the engine conditioned on), ``output_ids`` and
    ``log_probs`` (one per output id), ``finish_reason`` ("stop" | "length"), ``version`` (the
    weight version, or None), ``appended`` (the prompt extends the previous record's prompt +
    output), ``raw_text`` (the output decoded, special tokens kept: what the template re-renders)."""

    prompt_ids: List[int]
    output_ids: List[int]
    log_probs: List[float]
    finish_reason: str
    appended: bool
    version: Optional[int] = None
    raw_text: str = ""
    tool_call_ids: List[str] = field(default_factory=list)
    # with images (``images.ChatImages``): the prompt's images, their tensors and image-token mask
    images: Optional[Dict[str, Any]] = None

    @property
    def full_ids(self) -> List[int]:
        return self.prompt_ids + self.output_ids


def runs(records: Sequence[TurnRecord]) -> List[List[TurnRecord]]:
    """The records cut into maximal append-only runs (a record not ``appended`` starts a run)."""
    out: List[List[TurnRecord]] = []
    for r in records:
        if r.appended and out:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def run_sample(run: Sequence[TurnRecord], base: Sample) -> Sample:
    """One sample of an append-only run (module docstring); ``base`` gives the group, the index,
    the prompt text, the label and the metadata."""
    first, last = run[0], run[-1]
    tokens = last.full_ids
    start = len(first.prompt_ids)
    n = len(tokens) - start
    mask, log_probs = [0] * n, [0.0] * n
    versions = [None] * n
    for r in run:
        a = len(r.prompt_ids) - start  # the record's output starts here in the response
        b = a + len(r.output_ids)
        mask[a:b] = [1] * len(r.output_ids)
        log_probs[a:b] = r.log_probs
        versions[a:b] = [r.version] * len(r.output_ids)
    status = Sample.Status.COMPLETED if last.finish_reason == "stop" else Sample.Status.TRUNCATED
    return Sample(
        group_index=base.group_index,
        index=base.index,
        prompt=base.prompt,
        tokens=list(tokens),
        response_length=n,
        label=base.label,
        loss_mask=mask,
        rollout_log_probs=log_probs,
        # the engine's version on every token (None where the loop tracks none)
        weight_versions=None if any(v is None for v in versions) else versions,
        metadata={**base.metadata, "turns": len(run)},
        status=status,
        # the run's images: its last prompt's (an appended turn keeps the earlier ones, in order)
        multimodal_inputs=None if last.images is None else {"image": list(last.images["image"])},
        multimodal_train_inputs=None
        if last.images is None or last.images["pixel_values"] is None
        else {"pixel_values": last.images["pixel_values"], "image_grid_thw": last.images["image_grid_thw"]},
    )


def episode_samples(records: Sequence[TurnRecord], base: Sample) -> List[Sample]:
    """The samples of one episode's records (module docstring), in order."""
    return [run_sample(r, base) for r in runs(records)]


def non_append_turns(records: Sequence[TurnRecord]) -> int:
    """Turns after the first whose prompt did not extend the previous prompt + completion."""
    return sum(not r.appended for r in records[1:])


def episode_stats(episodes: Sequence[Sequence[TurnRecord]], seconds: Sequence[float]) -> Dict[str, Any]:
    """``agent/turns_mean`` (completions per episode), ``agent/calls`` (completions served),
    ``agent/episode_s`` (mean wall seconds of an episode), ``agent/non_append_turns`` and
    ``agent/completion_tokens`` (the output ids served: the sum of the ``usage.completion_tokens``
    the agents received)."""
    calls = sum(len(e) for e in episodes)
    return {
        "agent/turns_mean": calls / max(len(episodes), 1),
        "agent/calls": float(calls),
        "agent/episode_s": sum(seconds) / max(len(seconds), 1),
        "agent/non_append_turns": float(sum(non_append_turns(e) for e in episodes)),
        "agent/completion_tokens": float(sum(len(r.output_ids) for e in episodes for r in e)),
    }
