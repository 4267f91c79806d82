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

import math
import time
from typing import Dict, Optional

from rl_plugin.checkpoint.pending_rollout import PendingRollout
from rl_plugin.loop.advantages import sft_batch
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.schedule import RolloutLoop


class SftSchedule:
    def __init__(self, loop: RolloutLoop, cfg: LoopConfig):
        self._loop, self._cfg = loop, cfg
        self._source = loop.local_source()  # the SFT data, read in this process (no rollout manager)

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
        reports = loop.train_rollout(data, sync=False, batch=sft_batch(data))  # the NLL: no advantage
        timings = {"time/sft_batch": t_data, "time/train": time.perf_counter() - t1}
        loop.finish_rollout(k, data, reports, timings, t0, evaluate=self.evaluate)

    def evaluate(self, k: int) -> Dict[str, float]:
        """``eval/nll`` (token mean over every held-out assistant token), ``eval/ppl``, ``eval/tokens``."""
        nll, tokens = self._loop.eval_nll(sft_batch(self._source.eval_data()))
        mean = nll / max(tokens, 1.0)
        return {"eval/nll": mean, "eval/ppl": math.exp(min(mean, 700.0)), "eval/tokens": tokens}
