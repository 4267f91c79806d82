"""The model chunks of the interleaved (virtual) pipeline schedule.

With ``--num-layers-per-virtual-pipeline-stage`` (or ``--num-virtual-stages-per-pipeline-rank``) V > 1,
each pipeline rank holds V model chunks (megatron-core ``GPTModel(vp_stage=v)``, each under its own
DDP): virtual stage ``v * P + p`` (chunk ``v`` of pipeline rank ``p``) holds layers
``[(v * P + p) * L, (v * P + p + 1) * L)`` of ``L = layers / (P x V)``; the embedding is on chunk 0 of
the first rank, the final norm and head on chunk V-1 of the last, and megatron's interleaved schedule
(``get_forward_backward_func`` once ``virtual_pipeline_model_parallel_size`` is set) runs the list.

``ModelChunks`` is the backend's model then: an ``nn.ModuleList`` of the chunks (so the runner's
``train()`` / ``eval()`` / ``parameters()`` reach every chunk) with what the backend does to one DDP
model done to each (``zero_grad_buffer``, ``no_sync``). ``current`` is the chunk the schedule is
running (``set_current``, by ``step.run_schedule``'s forward step before it calls the runner's ``forward(i)``);
``is_head(chunk)`` whether it is the last chunk, the one that computes the log-probs on the last
pipeline rank. With one chunk per rank the backend keeps the plain DDP model (``chunks_of`` gives
``[model]``).
"""

from __future__ import annotations

import contextlib
from typing import List

import torch


class ModelChunks(torch.nn.ModuleList):
    """This pipeline rank's model chunks, in virtual-stage order (module docstring)."""

    def __init__(self, chunks):
        super().__init__(chunks)
        self.set_current(None)

    def set_current(self, chunk) -> None:
        """The chunk the schedule runs next; a plain attribute (``nn.Module.__setattr__`` would
        register it as one more submodule)."""
        object.__setattr__(self, "current", chunk)

    def zero_grad_buffer(self) -> None:
        for chunk in self:
            chunk.zero_grad_buffer()

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for chunk in self:
                stack.enter_context(chunk.no_sync())
            yield

    def is_head(self, chunk) -> bool:
        return chunk is self[len(self) - 1]


def chunks_of(model) -> List[torch.nn.Module]:
    """The model chunks: the ``ModelChunks``' list, or ``[model]`` for one chunk per rank."""
    return list(model) if isinstance(model, ModelChunks) else [model]
