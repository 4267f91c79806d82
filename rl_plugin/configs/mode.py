"""The run's mode: which kind of run this is, decided once from the flags and read everywhere below.

Today's four, from ``--loss-type``, ``--max-weight-staleness`` and ``--fully-async``:

- ``SYNC``: generate rollout k, train on it, sync the weights (``--max-weight-staleness 0``);
- ``OVERLAPPED``: one rollout generated ahead while the trainer trains (``--max-weight-staleness 1``
  without ``--fully-async``; slime's ``train_async.py``);
- ``FULLY_ASYNC``: a background worker generates into a buffer, weight updates reach it mid-trajectory
  (``--fully-async --max-weight-staleness K``; miles);
- ``SFT``: supervised fine-tuning on the data's conversations, nothing generated (``--loss-type sft_loss``).

This module is the one place those flags are compared (``Mode.of``, ``generates_ahead``); the run
config holds the result (``RunConfig.mode``) and the code below reads the mode's traits
(``mode.generates``, ``mode.generates_ahead``, ``mode.trains_nll``) or compares modes
(``run.mode is Mode.SFT``), never the flags. A new mode (a critic, images) is one more value here
with its traits, and one more file where it differs (its schedule, its rollout source), not another
set of ``if``s over the flags. PPO's critic (``--advantage-estimator ppo``) is no mode: it runs beside
the synchronous or the one-step-off schedule alike, so the run reads ``run.critic.enabled``
(``configs/critic.py``, which refuses it with ``FULLY_ASYNC`` and ``SFT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

SFT_LOSS = "sft_loss"  # --loss-type: the value that makes the run SFT


@dataclass(frozen=True)
class Traits:
    """What a mode does: ``generates`` (an engine samples the trained responses), ``generates_ahead``
    (generation overlaps training: an engine may load weights v - 1 while v is published, the
    placement gives both sides their cores at once), ``trains_nll`` (the per-token loss is the NLL
    of the data: no advantage, reward, old or reference pass), ``source`` (the kind of
    ``rl_plugin.rollout.source`` its rollouts come from: ``generation``, ``fully_async``, ``sft``)."""

    name: str
    generates: bool
    generates_ahead: bool
    trains_nll: bool
    source: str


class Mode(Enum):
    SYNC = Traits("sync", generates=True, generates_ahead=False, trains_nll=False, source="generation")
    OVERLAPPED = Traits("overlapped", generates=True, generates_ahead=True, trains_nll=False, source="generation")
    FULLY_ASYNC = Traits("fully_async", generates=True, generates_ahead=True, trains_nll=False, source="fully_async")
    SFT = Traits("sft", generates=False, generates_ahead=False, trains_nll=True, source="sft")

    @property
    def generates(self) -> bool:
        return self.value.generates

    @property
    def generates_ahead(self) -> bool:
        return self.value.generates_ahead

    @property
    def trains_nll(self) -> bool:
        return self.value.trains_nll

    @property
    def source(self) -> str:
        return self.value.source

    def __str__(self) -> str:
        return self.value.name

    @classmethod
    def of(cls, loss_type: str, max_weight_staleness: Optional[int], fully_async: bool) -> "Mode":
        """The mode the flags ask for (the rules refuse the combinations that make no sense, e.g.
        SFT with a staleness, ``--fully-async`` without one)."""
        if loss_type == SFT_LOSS:
            return cls.SFT
        if fully_async:
            return cls.FULLY_ASYNC
        return cls.OVERLAPPED if generates_ahead(max_weight_staleness) else cls.SYNC

    @classmethod
    def of_flags(cls, args) -> "Mode":
        """``Mode.of`` the parsed flags (the run config's ``mode`` field; the parser's SFT defaults)."""
        return cls.of(args.loss_type, args.max_weight_staleness, args.fully_async)


def generates_ahead(max_weight_staleness: Optional[int]) -> bool:
    """``--max-weight-staleness`` asks for generation ahead of training (> 0): overlapped, or fully
    async with ``--fully-async``."""
    return max_weight_staleness is not None and max_weight_staleness > 0
