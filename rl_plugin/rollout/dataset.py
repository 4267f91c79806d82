"""Prompt datasets from JSONL (``--prompt-data``, ``--input-key``, ``--label-key``), with a
resumable position.

The dataset is read once; every line must be a JSON object holding a non-empty input string (and
the label key, when one is configured); a bad line raises naming the file and line. Lines of
whitespace only hold no record and are skipped (a trailing newline is common in JSONL tools). Batches are taken in
order, wrapping around into a new epoch (reshuffled with ``seed + epoch`` when ``shuffle``), so
the position is just ``(epoch, offset)`` and ``state_dict`` / ``load_state_dict`` restore it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional


@dataclass
class PromptRecord:
    prompt: str
    label: Any
    index: int  # record index in the file (0-based; blank lines are skipped)
    lineno: int = 0  # line number in the file (1-based), for messages


def read_jsonl(path, input_key: str, label_key: Optional[str]) -> List[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: no such file")
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            if input_key not in row:
                raise ValueError(f"{path}:{lineno}: no key {input_key!r} (--input-key); keys are {sorted(row)}")
            if label_key is not None and label_key not in row:
                raise ValueError(f"{path}:{lineno}: no key {label_key!r} (--label-key); keys are {sorted(row)}")
            prompt = row[input_key]
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{lineno}: {input_key!r} must be a string, got {type(prompt).__name__}")
            if not prompt.strip():
                raise ValueError(
                    f"{path}:{lineno}: {input_key!r} is empty; the model needs a prompt to answer. Fix: remove the line or fill in its prompt"
                )
            records.append(PromptRecord(prompt, row.get(label_key) if label_key else None, len(records), lineno))
    if not records:
        raise ValueError(f"--prompt-data {path}: the file holds no prompts")
    return records


class PromptDataset:
    def __init__(self, records: List[PromptRecord], *, shuffle: bool = False, seed: int = 0):
        self.records, self.shuffle, self.seed = records, shuffle, seed
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_jsonl(cls, path, input_key: str = "prompt", label_key: Optional[str] = "label", **kw) -> "PromptDataset":
        return cls(read_jsonl(path, input_key, label_key), **kw)

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> List[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> List[PromptRecord]:
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.offset)
            out.extend(self.records[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)
