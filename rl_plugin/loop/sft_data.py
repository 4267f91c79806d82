"""The SFT run's data side, in the driver's process: no rollout manager, no engine.

``SftData`` reads ``--prompt-data`` (and ``--eval-prompt-data``) with the rollout's dataset code
(``rl_plugin.rollout.data.dataset``: JSONL / Parquet, ``--input-key`` / ``--label-key``, the
shuffled, resumable position) and turns each batch of ``--rollout-batch-size`` records into the
loss core's flat layout with ``rl_plugin.rollout.data.sft`` (the chat template applied once, the
assistant-span mask). A record is templated once per run (cached by its index): a later epoch
reuses its ids.

It stands where the RL run's ``RolloutClient`` stands (the run and the driver call the same few
methods: the dataset position a checkpoint saves and a resume restores, ``kill``, ``abort``), so
the run's start-up, checkpoint and resume code is the RL run's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from rl_plugin.configs import RolloutConfig
from rl_plugin.rollout.data.dataset import PromptDataset, PromptRecord, read_prompts
from rl_plugin.rollout.data.sft import SftExample, example_of, sft_tensors
from rl_plugin.rollout.data.tokenizer import load_tokenizer
from rl_plugin.rollout.rollout_data import RolloutData


def read_sft_records(path, cfg: RolloutConfig) -> List[PromptRecord]:
    """The records of an SFT file: ``--input-key``, and ``--label-key`` where a record has it."""
    return read_prompts(path, cfg.input_key, cfg.label_key, label_optional=True)


class SftData:
    def __init__(self, args):
        cfg = RolloutConfig.from_args(args)
        self.batch_size = cfg.rollout_batch_size
        self.tokenizer = load_tokenizer(
            args.hf_checkpoint,
            apply_chat_template=cfg.apply_chat_template,
            chat_template_kwargs=cfg.apply_chat_template_kwargs,
            system_prompt=cfg.system_prompt,
        )
        self.train = PromptDataset(read_sft_records(cfg.prompt_data, cfg), shuffle=cfg.rollout_shuffle, seed=cfg.seed)
        self.eval = PromptDataset(read_sft_records(cfg.eval_prompt_data, cfg)) if cfg.eval_prompt_data else None
        self._cache: Dict[int, SftExample] = {}
        # every record is templated now: a bad conversation fails the run before any step
        for rec in self.train.records:
            self._example(rec)
        self._eval_data = (
            self._rollout([example_of(self.tokenizer, r) for r in self.eval.records]) if self.eval else None
        )
        # the RolloutClient surface the run and the driver use
        self.dataset_state: Optional[Dict[str, Any]] = None
        self.restarts = 0
        self.engines: List[Any] = []
        self.poll: Callable[[bool], None] = lambda can_abandon: None
        self.on_restart: Callable[[], None] = lambda: None
        self.on_fresh_engines: Callable[[], None] = lambda: None

    def _example(self, rec: PromptRecord) -> SftExample:
        ex = self._cache.get(rec.index)
        if ex is None:
            ex = self._cache[rec.index] = example_of(self.tokenizer, rec)
        return ex

    @staticmethod
    def _rollout(examples: List[SftExample]) -> RolloutData:
        t = sft_tensors(examples)
        n = t["total_lengths"].numel()
        trained = float(t["loss_mask"].sum())
        return RolloutData(
            tokens=t["tokens"],
            total_lengths=t["total_lengths"],
            response_lengths=t["response_lengths"],
            rollout_log_probs=torch.zeros(0),  # nothing sampled (``loop.steps.sft_batch`` reads none)
            rewards=torch.zeros(n),
            group_ids=torch.arange(n),  # every conversation its own group
            num_groups=n,
            loss_mask=t["loss_mask"],
            stats={"response_len_mean": trained / max(n, 1), "truncated_frac": 0.0},
        )

    def next_batch(self, k: int) -> RolloutData:
        """Batch ``k``: the next ``--rollout-batch-size`` conversations (wrapping into a new epoch)."""
        data = self._rollout([self._example(r) for r in self.train.next_batch(self.batch_size)])
        self.dataset_state = data.dataset_state = self.state_dict()
        return data

    def eval_data(self) -> Optional[RolloutData]:
        """Every held-out conversation (``--eval-prompt-data``), or None."""
        return self._eval_data

    # -- the RolloutClient surface -------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The rollout manager's form (``{"train_dataset": ...}``): an SFT checkpoint ``--load``s
        into an RL run, whose manager continues at the same data position."""
        return {"train_dataset": self.train.state_dict()}

    def read_dataset_state(self) -> None:
        self.dataset_state = self.state_dict()

    def call(self, method: str, *args):
        if method != "load_state_dict":
            raise ValueError(f"the SFT data source has no {method!r} (no rollout manager runs under sft_loss)")
        self.train.load_state_dict(args[0]["train_dataset"])
        self.dataset_state = self.state_dict()

    def engine_node_ids(self):
        return ()

    def abort(self) -> None:
        return None

    def kill(self) -> None:
        pass
