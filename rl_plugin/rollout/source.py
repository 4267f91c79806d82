"""Where a run's rollouts come from: one *source* per mode, behind one small protocol.

A source makes rollout k's ``RolloutData`` and owns the data position a checkpoint saves:

- ``GENERATION`` (``generation/source.py``, ``GenerationSource``): RL generation on the engine
  fleet, the default generate function, a generate hook, a whole-rollout function or an agent
  program per sample; synchronous and overlapped runs (the schedule decides when it is called);
- ``FULLY_ASYNC`` (``fully_async/source.py``, ``FullyAsyncSource``, ``--fully-async``): taken from
  the background worker's buffer;
- ``SFT`` (``sft_source.py``, ``SftSource``, ``--loss-type sft_loss``): the next conversations of
  the data, templated with their assistant masks; no engine, no weights.

The first two live in the rollout manager's actor beside its engine fleet (``fleet.py``; the
manager calls them, ``manager.py``); the SFT source lives in the driver's process (the loop calls
it). The run's mode names its kind (``rl_plugin.configs.mode``, ``Mode.source``: decided once,
with the mode), and ``make_source`` is the one place a kind becomes a source: a new mode is one
more kind and one more source module.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol

from rl_plugin.rollout.sample import RolloutData
from rl_plugin.weight_sync import SyncHandle

GENERATION, FULLY_ASYNC, SFT = "generation", "fully_async", "sft"
KINDS = (GENERATION, FULLY_ASYNC, SFT)


class RolloutSource(Protocol):
    """One mode's rollouts and the data position a checkpoint saves."""

    def rollout(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> RolloutData:
        """Rollout ``rollout_id``; ``handle`` (a weight sync, or None) loaded into the engines
        first. ``data.dataset_state`` is the position after it."""

    def state_dict(self) -> Dict[str, Any]:
        """The data position: ``{"train_dataset": ...}`` (plus ``async_requeue``, prompts taken and
        not trained on, which a resumed run trains first)."""

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A checkpoint's position (``state_dict``'s form)."""


def make_source(kind: str, **parts: Any) -> RolloutSource:
    """The source of ``kind`` built from its parts: ``generation`` (a ``GenerationSource``), plus
    ``fleet`` and ``async_settings`` for ``FULLY_ASYNC``; ``config`` and ``checkpoint_dir`` for
    ``SFT``."""
    if kind == GENERATION:
        return parts["generation"]
    if kind == FULLY_ASYNC:
        from rl_plugin.rollout.fully_async.source import FullyAsyncSource

        return FullyAsyncSource(parts["generation"], parts["fleet"], parts["async_settings"])
    if kind == SFT:
        from rl_plugin.rollout.sft_source import SftSource

        return SftSource(parts["config"], parts["checkpoint_dir"])
    raise ValueError(f"unknown rollout source {kind!r} (one of {', '.join(KINDS)})")
