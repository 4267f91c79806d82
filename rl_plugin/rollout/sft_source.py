"""The SFT source (``--loss-type sft_loss``), in the driver's process: no rollout manager, no engine.

``SftSource`` reads ``--prompt-data`` (and ``--eval-prompt-data``) with the rollout's dataset code
(``rl_plugin.rollout.data.dataset``: JSONL / Parquet, ``--input-key`` / ``--label-key``, the
shuffled, resumable position) and turns each batch of ``--rollout-batch-size`` records into the
loss core's flat layout with ``rl_plugin.rollout.data.sft`` (the chat template applied once, the
assistant-span mask; with ``--multimodal-keys`` each record's images through the processor,
``rollout.data.vl_sft``). A record is templated once per run (cached by its index, its processed
images too): a later epoch reuses its ids.

It is a ``RolloutSource`` (``rollout/source.py``): the SFT schedule calls ``rollout(k)``, the
driver its ``eval_data`` and the data position a checkpoint saves and a resume restores (the
rollout manager's form, so an SFT checkpoint starts an RL run at the same position).
Its files are checked before Ray starts by ``rollout.data.prompt_check.check_sft_file``
(``arguments.file_contents``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from rl_plugin.configs import RolloutConfig
from rl_plugin.rollout.data.dataset import PromptDataset, PromptRecord, read_prompts
from rl_plugin.rollout.data.prompt_queue import PromptQueue
from rl_plugin.rollout.data.sft import SftExample, sft_tensors
from rl_plugin.rollout.data.vl_prompt import rollout_prompts
from rl_plugin.rollout.data.vl_sft import sft_example
from rl_plugin.rollout.sample import RolloutData


def read_sft_records(path, cfg: RolloutConfig) -> List[PromptRecord]:
    """The records of an SFT file: ``--input-key``, and ``--label-key`` where a record has it
    (``--multimodal-keys``: each record's images too)."""
    image_key = cfg.multimodal.image_key
    return read_prompts(path, cfg.input_key, cfg.label_key, label_optional=True, image_key=image_key)


class SftSource:
    """The SFT source (``rollout.source.RolloutSource``): batch k is the next
    ``--rollout-batch-size`` conversations, templated once with their assistant masks."""

    def __init__(self, config: RolloutConfig, checkpoint_dir: str):
        cfg = config
        self.batch_size = cfg.rollout_batch_size
        self.tokenizer = rollout_prompts(cfg, checkpoint_dir)  # with images: the processor's (VLPrompts)
        train = PromptDataset(read_sft_records(cfg.prompt_data, cfg), shuffle=cfg.rollout_shuffle, seed=cfg.seed)
        self.prompts = PromptQueue(train)
        self.eval = PromptDataset(read_sft_records(cfg.eval_prompt_data, cfg)) if cfg.eval_prompt_data else None
        self._cache: Dict[int, SftExample] = {}
        # every record is templated now: a bad conversation fails the run before any step
        for rec in train.records:
            self._example(rec)
        self._eval_data = (
            self._batch([sft_example(self.tokenizer, r) for r in self.eval.records]) if self.eval else None
        )

    def rollout(self, rollout_id: int, handle: None = None) -> RolloutData:
        """Batch ``rollout_id``: the next ``--rollout-batch-size`` conversations (wrapping into a
        new epoch; a fully-async checkpoint's re-queued records first). No engine: no ``handle``."""
        data = self._batch([self._example(r) for r in self.prompts.next_batch(self.batch_size)])
        data.dataset_state = self.state_dict()
        return data

    def eval_data(self) -> Optional[RolloutData]:
        """Every held-out conversation (``--eval-prompt-data``), or None."""
        return self._eval_data

    def state_dict(self) -> Dict[str, Any]:
        """The rollout manager's form (``{"train_dataset": ...}``): an SFT checkpoint ``--load``s
        into an RL run, whose manager continues at the same data position."""
        return self.prompts.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)

    def _example(self, rec: PromptRecord) -> SftExample:
        ex = self._cache.get(rec.index)
        if ex is None:
            ex = self._cache[rec.index] = sft_example(self.tokenizer, rec)
        return ex

    @staticmethod
    def _batch(examples: List[SftExample]) -> RolloutData:
        """Conversations in the loss core's flat layout: nothing sampled, so no rollout log-probs
        and no reward (``loop.advantages.sft_batch`` reads neither); every conversation its own group."""
        t = sft_tensors(examples)
        n = t["total_lengths"].numel()
        trained = float(t["loss_mask"].sum())
        return RolloutData(
            tokens=t["tokens"],
            total_lengths=t["total_lengths"],
            response_lengths=t["response_lengths"],
            rollout_log_probs=None,
            rewards=None,
            group_ids=torch.arange(n),
            num_groups=n,
            loss_mask=t["loss_mask"],
            pixel_values=t.get("pixel_values"),  # images (vl_sft): model inputs only
            image_grid_thw=t.get("image_grid_thw"),
            image_counts=t.get("image_counts"),
            stats={"response_len_mean": trained / max(n, 1), "truncated_frac": 0.0},
        )
