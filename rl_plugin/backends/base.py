"""The interface every training backend implements (one instance per training process).

The loop (``rl_plugin.train`` / ``rl_plugin.ray``) only talks to this interface, so a backend is
chosen by ``--train-backend`` and nothing above this layer knows megatron-core or FSDP.

Data contract: a ``StepBatch`` (``rl_plugin.loss.batch``) holds THIS data-parallel rank's samples,
full sequences (CP/TP ranks of the same DP rank receive the same batch; the backend slices for
CP). ``group_ids`` are step-local prompt-group ids shared across DP ranks, ``num_groups`` the
step's group count.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Optional

import torch

from rl_plugin.configs import TrainConfig
from rl_plugin.loss.batch import StepBatch
from rl_plugin.parallel import ParallelState


class TrainBackend(abc.ABC):
    parallel_state: ParallelState

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: TrainConfig) -> "TrainBackend":
        """Build model, optimizer and groups; torch.distributed is already initialised."""

    @classmethod
    def from_args(cls, args) -> "TrainBackend":
        """``from_config(TrainConfig.from_args(args))``, for callers holding validated flags."""
        return cls.from_config(TrainConfig.from_args(args))

    @abc.abstractmethod
    def compute_log_probs(self, batch: StepBatch, *, role: str = "actor") -> torch.Tensor:
        """Forward only: per-response-token log-probs ``[sum R_i]`` (fp32, full responses, at
        ``--rollout-temperature``) of the ``actor`` or the frozen ``ref`` model."""

    @abc.abstractmethod
    def train_step(self, batch: StepBatch, *, num_groups: int, micro_batches: Optional[List[torch.Tensor]] = None) -> Dict[str, Any]:
        """One optimizer step applying exactly dJ/dtheta; returns J and the metrics
        (``loss``, ``pg_loss``, ..., ``grad_norm``, ``lr`` = the rate this step used), identical on
        every rank. ``micro_batches`` (sample indices) is the loop's plan (``--docs-per-step``);
        None lets the backend plan with ``rl_plugin.batching.plan_micro_batches``."""

    @abc.abstractmethod
    def export_hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full (unsharded, TP-gathered) weights under Hugging Face names, on every rank."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str, *, step: int, extra: Optional[Dict[str, Any]] = None) -> None:
        """Model + optimizer + RNG + step (+ the loop's ``extra`` state); collective."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns ``{"step": int, "extra": {...}}``."""
