"""The model-input half of a micro-batch, shared by the train step and forward-only passes.

``MicroBatchInputs.build(sub_batch, ...)`` lays one micro-batch out for one CP rank
(``cp.build_response_layout``) and takes from it what a model forward needs: local ``input_ids``
and ``position_ids`` (thd: ``[sum local_len]``; bshd: ``[S, local_seq_len]``) and the ``targets``
predicted at each local response position. ``StepContext.micro_batch`` adds the loss-side
slices on top; backends use it alone for old-policy / reference log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rl_plugin.cp import ResponseLayout, build_response_layout
from rl_plugin.loss.batch import StepBatch


@dataclass
class MicroBatchInputs:
    layout: ResponseLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def build(
        cls,
        sub_batch: StepBatch,
        *,
        cp_rank: int = 0,
        cp_size: int = 1,
        qkv_format: str = "thd",
        max_seq_len: Optional[int] = None,
    ) -> "MicroBatchInputs":
        layout = build_response_layout(
            sub_batch.total_lengths,
            sub_batch.response_lengths,
            cp_rank=cp_rank,
            cp_size=cp_size,
            qkv_format=qkv_format,
            max_seq_len=max_seq_len,
        )
        return cls(
            layout=layout,
            input_ids=layout.local_inputs(sub_batch.tokens),
            position_ids=layout.local_position_ids(),
            targets=layout.targets(sub_batch.tokens),
        )
