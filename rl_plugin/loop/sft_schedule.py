"""The SFT schedule (``--loss-type sft_loss``)::

    batch(k)    the next --rollout-batch-size conversations of --prompt-data, templated once
                with their assistant-span loss masks (the SFT source, ``rollout/sft_source.py``,
                in this process)
    train(k)    the optimizer steps of the batch (--global-batch-size splits it as in RL), the
                per-token loss being the NLL; no old / reference pass, no advantage
    log, save, eval (the held-out NLL of --eval-prompt-data)

No rollout engine exists, so no weights are published (the run skips its first weight sync too);
``--save-hf`` writes the model at the end as in RL, and a checkpoint of an SFT run starts an RL run
with ``--load`` (its dataset position is the SFT data's; an RL run over other data starts from
its --hf-checkpoint instead). Nothing is generated ahead, so ``pending`` is always None.
"""

from __future__ import annotations

import time
from typing import Optional

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.schedule import RolloutLoop
from rl_plugin.rollout.source import RolloutSource


class SftSchedule:
    def __init__(self, loop: RolloutLoop, cfg: LoopConfig, source: RolloutSource):
        self._loop, self._cfg, self._source = loop, cfg, source

    def pending(self) -> Optional[PendingRollout]:
        return None

    def resume(self, pending: Optional[PendingRollout]) -> None:
        if pending is not None:
            raise ValueError(
                f"the checkpoint holds rollout {pending.rollout_id} generated ahead by an overlapped RL run; "
                "--loss-type sft_loss trains on data, not rollouts. Fix: --load a checkpoint written after a "
                "complete rollout, or start the SFT run from its --hf-checkpoint"
            )

    def run_rollout(self, k: int) -> None:
        """Batch k: its conversations, the optimizer steps on them, then rows, checkpoint, eval."""
        loop = self._loop
        t0 = time.perf_counter()
        data = self._source.rollout(k)
        t_data = time.perf_counter() - t0
        t1 = time.perf_counter()
        reports = loop.train_rollout(data, sync=False)
        timings = {"time/sft_batch": t_data, "time/train": time.perf_counter() - t1}
        loop.finish_rollout(k, data, reports, timings, t0)
