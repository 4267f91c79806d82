"""What a schedule is, and what it may ask of the rollout's pieces.

A schedule decides the order of one rollout's phases (generate, train, publish the weights) and
owns what carries over between rollouts: the rollout generated ahead (``PendingRollout``, the
value a checkpoint keeps: ``rl_plugin.checkpoint.pending_rollout``). The
run (``loop/run.py``, through ``RolloutPieces`` in ``loop/rollout_pieces.py``) calls
``Schedule.run_rollout(k)`` once per rollout, ``RolloutPieces`` reads
``pending()`` when it writes a checkpoint and hands a resumed checkpoint's to ``resume``.

A schedule calls ``RolloutPieces`` only through ``RolloutLoop``, the named pieces of a rollout; it
never imports it nor reads its fields. The implementations: ``SyncSchedule``
(``sync_schedule.py``, the default), ``OverlappedSchedule`` (``overlapped_schedule.py``,
``--max-weight-staleness 1``) and ``FullyAsyncSchedule`` (``fully_async_schedule.py``,
``--fully-async``); another schedule is one more file implementing ``Schedule``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loss import StepBatch
from rl_plugin.rollout.sample import RolloutData

Reports = List[Dict[str, Any]]  # one report per optimizer step of a rollout (J, metrics, samples, time/*)


class RolloutLoop(Protocol):
    """The pieces of a rollout a schedule calls (``RolloutPieces``); each is one phase of a rollout."""

    def generate(self, k: int) -> RolloutData:
        """Rollout k, the newest published weights loaded first; retried on a fresh manager."""

    def submit_generate(self, k: int) -> Any:
        """Start rollout k's generate (the newest published weights loaded first); returns the
        call in flight, for ``wait_generate``."""

    def wait_generate(self, k: int, in_flight: Any) -> RolloutData:
        """The answer of ``submit_generate(k)``; retried on a fresh manager when it died."""

    def take(self, k: int) -> RolloutData:
        """Fully async: rollout k from the rollout manager's buffer (the newest published weights
        loaded first, at its worker's next token boundary)."""

    def manager_restarts(self) -> int:
        """Rollout managers replaced so far (a fresh one holds the trainer's current weights)."""

    def local_source(self) -> Optional[Any]:
        """The mode's rollout source when it runs in this process (SFT's data), else None."""

    def train_rollout(self, data: RolloutData, sync: bool = False, batch: Optional[StepBatch] = None) -> Reports:
        """The rollout's optimizer steps (``batch``: the schedule's own step batch; default the
        advantages of the rollout's rewards); with ``sync`` rank 0 then publishes the new weights."""

    def eval_nll(self, batch: StepBatch) -> Tuple[float, float]:
        """``batch``'s NLL summed over its trained tokens, and their count (a held-out forward)."""

    def sync_timings(self) -> Dict[str, float]:
        """The weight sync's ``time/*`` entries since the last call."""

    def log_steps(
        self,
        k: int,
        data: RolloutData,
        reports: Reports,
        timings: Dict[str, float],
        t0: float,
        staleness: Optional[int],
    ) -> None:
        """Rollout k's metrics rows (one per step report)."""

    def finish_rollout(
        self,
        k: int,
        data: RolloutData,
        reports: Reports,
        timings: Dict[str, float],
        t0: float,
        staleness: Optional[int] = None,
        evaluate: Optional[Callable[[int], Dict[str, float]]] = None,
    ) -> None:
        """Rollout k's rows, then its checkpoint and eval when due (``evaluate``: the schedule's
        own eval instead of the rollout manager's)."""


class Schedule(Protocol):
    """One rollout's phases in order, and the state that carries over to the next rollout."""

    def run_rollout(self, k: int) -> None:
        """Rollout k, from its generate to its rows, checkpoint and eval."""

    def pending(self) -> Optional[PendingRollout]:
        """The rollout generated ahead, which a checkpoint written now must hold (None: none)."""

    def resume(self, pending: Optional[PendingRollout]) -> None:
        """A resumed checkpoint's rollout generated ahead: trained on first, as it was."""
