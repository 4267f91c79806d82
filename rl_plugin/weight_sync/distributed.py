"""Distributed transport (``--update-weight-transport nccl``): a torch.distributed group between
train rank 0 and the engines' workers, one broadcast per bucket (NCCL on GPUs, gloo on CPU; vLLM
through its worker extension / ``collective_rpc``, SGLang through ``/init_weights_update_group`` +
``/update_weights_from_distributed``, as slime and verl do).

Not implemented in this build: constructing the writer fails loud, naming what to use instead.
It is the third implementation of ``transport.TransportWriter`` / ``TransportReader``; the
publisher and receiver need no change to take it.
"""

from __future__ import annotations

from typing import Dict

import torch

from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.transport import TransportWriter


class DistributedWriter(TransportWriter):
    name = "nccl"

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--update-weight-transport nccl: the NCCL weight broadcast needs CUDA GPUs on the trainer and the "
                "rollout engines; on CPU use --update-weight-transport auto (shared memory / object store)"
            )
        raise NotImplementedError(
            "--update-weight-transport nccl: the NCCL weight broadcast between train rank 0 and the rollout "
            "engines is not implemented yet; use --update-weight-transport auto"
        )

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:  # pragma: no cover
        raise NotImplementedError
