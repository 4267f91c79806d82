"""Engine ``Generation``s as the default generate function's ``Sample``s, for tests of the
flattener (``flatten.flatten_samples``) that start from an engine's answer."""

from __future__ import annotations

from typing import List, Sequence

from rl_plugin.rollout.data.dataset import PromptRecord
from rl_plugin.rollout.engines.base import Generation
from rl_plugin.rollout.generation.default import build_samples
from rl_plugin.rollout.sample import Sample


def samples_of(gens: Sequence[Generation]) -> List[Sample]:
    """One sample per generation (each its own group), blank prompts and responses."""
    recs = [PromptRecord("", None, i) for i in range(len(gens))]
    return build_samples(recs, gens, [""] * len(gens), 1)
