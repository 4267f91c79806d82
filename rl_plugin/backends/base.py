"""The interface every training backend implements (one instance per training process).

The loop (``rl_plugin.train`` / ``rl_plugin.ray``) only talks to this interface, so a backend is
chosen by ``--train-backend`` and nothing above this layer knows megatron-core or FSDP.

Data contract: a ``StepBatch`` (``rl_plugin.loss``) holds THIS data-parallel rank's samples,
full sequences (CP/TP ranks of the same DP rank receive the same batch; the runner slices for
CP). ``group_ids`` are step-local prompt-group ids shared across DP ranks, ``num_groups`` the
step's group count.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from rl_plugin.configs import TrainConfig
from rl_plugin.loss import (
    DEFAULT_VALUE_CLIP,
    ForwardFn,
    ForwardOptions,
    LossConfig,
    LossFn,
    MicroBatchInputs,
    StepBatch,
    StepRunner,
)
from rl_plugin.parallel import ParallelState
from rl_plugin.routing.passes import agreement_metrics, assemble_recorded, routing_action


class TrainBackend(abc.ABC):
    """A backend: the runner's ``StepBackend`` (``forward``, ``schedule``, ``optimizer_step``,
    ``loss_device``; see ``rl_plugin.loss.StepBackend``), weights export and checkpoints. The step
    itself is the core's: ``compute_log_probs`` and ``train_step`` delegate to ``self.runner``, as
    do a value model's (``config.value_head``) ``compute_values`` and ``value_train_step``."""

    parallel_state: ParallelState
    loss_device: torch.device
    loss_config: LossConfig
    runner: StepRunner

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: TrainConfig) -> "TrainBackend":
        """Build model, optimizer and groups; torch.distributed is already initialised."""

    @classmethod
    def from_args(cls, args) -> "TrainBackend":
        """``from_config`` of the run config's ``TrainConfig`` (its mode given to the loss), for
        callers holding validated flags."""
        from rl_plugin.configs.run import RunConfig

        return cls.from_config(RunConfig.from_args(args).train)

    # -- what the runner calls (rl_plugin.loss.StepBackend) -------------------------------------
    @abc.abstractmethod
    def forward(self, model, inputs: MicroBatchInputs, options: ForwardOptions) -> torch.Tensor:
        """``[n_local, 2]`` (log-prob, entropy) of one micro-batch's local response tokens, on
        ``loss_device``; a micro-batch with no sample gives ``[0, 2]``. With ``options.values``
        (a value model): ``[n_local, 1]`` fp32 values (``[0, 1]`` for no sample)."""

    @abc.abstractmethod
    def schedule(self, model, num_micro_batches: int, forward: ForwardFn, loss: LossFn, *, forward_only: bool) -> int:
        """Run ``loss(i, forward(i))`` over this rank's micro-batches (backward unless
        ``forward_only``, scaled to cancel the backend's averaging); returns the passes run."""

    @abc.abstractmethod
    def optimizer_step(self) -> Tuple[float, float]:
        """Apply the accumulated gradient: ``(grad_norm before clipping, lr this step used)``."""

    @abc.abstractmethod
    def model_for(self, role: str):
        """The ``actor`` model or the frozen ``ref`` model (the ``--hf-checkpoint`` weights); on a
        value model (``config.value_head``), the ``critic``."""

    # -- what the loop calls --------------------------------------------------------------------
    def compute_log_probs(
        self, batch: StepBatch, *, role: str = "actor", micro_batches: Optional[List[torch.Tensor]] = None
    ) -> torch.Tensor:
        """Forward only: per-response-token log-probs ``[sum R_i]`` (fp32, CPU, full responses, at
        ``--rollout-temperature``) of the ``actor``, the frozen ``ref`` model or the ``teacher``
        (``--use-opd --opd-type megatron``: ``--opd-teacher-load``, forward only)."""
        if role not in ("actor", "ref", "teacher"):
            raise ValueError(f"compute_log_probs: role must be 'actor', 'ref' or 'teacher', got {role!r}")
        self._policy_only("compute_log_probs")
        action = routing_action(self.config.routing_replay, batch.routed_experts, role=role, training=False)
        records = [] if action == "record" else None
        with self._routing(action):
            out = self.runner.log_probs(self.model_for(role), batch, micro_batches, routing_sink=records)
        if records:  # R2: the training passes replay what this pass routed
            batch.routed_experts = assemble_recorded(records, batch.tokens.numel())
        return out

    def train_step(
        self,
        batch: StepBatch,
        *,
        num_groups: int,
        micro_batches: Optional[List[torch.Tensor]] = None,
        old_from_forward: bool = False,
    ) -> Dict[str, Any]:
        """One optimizer step applying exactly dJ/dtheta; returns J and the metrics
        (``loss``, ``pg_loss``, ..., ``grad_norm``, ``lr`` = the rate this step used,
        ``num_micro_batches``), identical on every rank. ``micro_batches`` (sample indices) is the
        loop's plan (``--docs-per-step``); None plans with the runner's one planner.
        ``old_from_forward``: the old log-probs are this step's detached training log-probs
        (``runner.old_log_probs_rule`` says when that is exact)."""
        self._policy_only("train_step")
        action = routing_action(self.config.routing_replay, batch.routed_experts, role="actor", training=True)
        with self._routing(action) as routing:
            report = self.runner.train_step(
                self.model_for("actor"),
                batch,
                num_groups=num_groups,
                micro_batches=micro_batches,
                old_from_forward=old_from_forward,
            )
        if routing is not None and routing.action == "replay":
            report.update(agreement_metrics(routing.agreement, self.parallel_state.dp_cp_group))
        return report

    # -- the value model (TrainConfig.value_head; rl_plugin.loss.value_step) -----------------------
    def compute_values(self, batch: StepBatch, *, micro_batches: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Forward only: the value model's V(s_t) of every response token, ``[sum R_i]`` (fp32,
        CPU, full responses, batch order): the critic's "old values" of a rollout."""
        model = self._value_model("compute_values")
        return self.runner.values(model, batch, micro_batches)

    def value_train_step(
        self,
        batch: StepBatch,
        *,
        num_groups: int,
        micro_batches: Optional[List[torch.Tensor]] = None,
        value_clip: float = DEFAULT_VALUE_CLIP,
    ) -> Dict[str, Any]:
        """One optimizer step of the value model on ``batch`` (its ``values`` and ``returns`` set):
        ``value_loss``, ``vf_clipfrac``, ``values_mean``, ``grad_norm``, ``lr``,
        ``num_micro_batches``, identical on every rank. ``value_clip``: ``--value-clip``."""
        model = self._value_model("value_train_step")
        return self.runner.value_step(
            model,
            batch,
            num_groups=num_groups,
            micro_batches=micro_batches,
            value_clip=value_clip,
        )

    def _value_model(self, what: str):
        if not self.config.value_head:
            raise ValueError(
                f"{what}: this {type(self).__name__} is a policy (TrainConfig.value_head is False); "
                "the critic's backend is built from run.critic_train"
            )
        return self.model_for("critic")

    def _policy_only(self, what: str) -> None:
        if self.config.value_head:
            raise ValueError(
                f"{what}: this {type(self).__name__} is a value model (TrainConfig.value_head); it has no LM head. "
                "Use compute_values / value_train_step"
            )

    # -- routing replay (rl_plugin.routing.passes) ---------------------------------------------
    routing_pass = None  # the RoutingPass of the pass running now; ``forward`` enters its context

    def new_routing_pass(self, action: str):
        """This backend's ``RoutingPass`` for ``action`` ("replay" / "record")."""
        raise ValueError(
            f"routing replay (--use-rollout-routing-replay / --use-routing-replay): {type(self).__name__} has none"
        )

    @contextlib.contextmanager
    def _routing(self, action: Optional[str]):
        """``routing_pass`` set for the block (None: free routing)."""
        if action is None:
            yield None
            return
        self.routing_pass = self.new_routing_pass(action)
        try:
            yield self.routing_pass
        finally:
            self.routing_pass = None

    def deterministic_forward(self) -> bool:
        """Whether the training forward computes what the eval forward does (no dropout)."""
        return True

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """The rank's training state on its device, for ``--offload-train`` (``backends/offload.py``):
        the model's and the reference model's parameters, gradients and buffers, and the optimizer's
        state and main params. A backend holding more (a third model) extends it."""
        from rl_plugin.backends.offload import module_tensors, optimizer_tensors

        yield from module_tensors(getattr(self, "model", None))
        yield from module_tensors(getattr(self, "_ref_model", None))
        yield from optimizer_tensors(getattr(self, "optimizer", None))

    @abc.abstractmethod
    def export_hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full (unsharded, TP-gathered) weights under Hugging Face names, on every rank."""

    def hf_weight_specs(self) -> Optional[Dict[str, torch.Tensor]]:
        """What ``stream_hf_weights`` will yield, without materialising it: one meta tensor (shape,
        dtype) per Hugging Face name, in export order; local (no collective), read on the exporting
        rank. None when the backend cannot tell before exporting (the weight sync then publishes
        ``export_hf_state_dict``)."""
        return None

    def stream_hf_weights(self, *, host: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The export as a stream, collective: EVERY rank must exhaust it. Global rank 0 (the
        exporting rank) gets ``(hf_name, CPU tensor)`` in the order of ``hf_weight_specs`` (with
        ``host=False``: the tensor where the gather left it, the device, for a transport that sends
        from there: ``WeightPublisher.host_tensors``), each
        materialised only when reached and valid until the weights change; the other ranks get
        nothing and only take part in the gathers they must. This default materialises
        ``export_hf_state_dict`` on every rank (a backend without a streaming export)."""
        sd = self.export_hf_state_dict()
        if not dist.is_initialized() or dist.get_rank() == 0:
            yield from sd.items()

    # -- LoRA (--lora-rank; rl_plugin.lora) ------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        """Whether this backend trains LoRA adapters (then a weight sync carries only them)."""
        return self.config.lora.enabled

    def lora_adapter_specs(self) -> Dict[str, torch.Tensor]:
        """What ``stream_lora_adapters`` will yield: canonical name -> meta tensor (full shape,
        fp32), in export order. Every rank calls it (a backend may gather the layout over its
        pipeline stages once; FSDP's is local)."""
        raise NotImplementedError(f"{type(self).__name__}: no LoRA adapters to describe (--lora-rank)")

    def stream_lora_adapters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The adapters as a stream, collective like ``stream_hf_weights``: the exporting rank
        (global rank 0) gets ``(canonical name, full fp32 CPU tensor)`` for every ``lora_A`` /
        ``lora_B`` (``rl_plugin.lora.names``: PEFT's names on the HF model, whatever the
        backend), the other ranks nothing."""
        raise NotImplementedError(f"{type(self).__name__}: no LoRA adapters to stream (--lora-rank)")

    @abc.abstractmethod
    def save_checkpoint(self, path: str, *, step: int, extra: Optional[Dict[str, Any]] = None) -> List[str]:
        """Model + optimizer + RNG + step (+ the loop's ``extra`` state); collective. Returns the
        files this rank wrote into ``path``, relative to it (``commit_save`` checks the committing
        process sees them all: ``rl_plugin.checkpoint.written_files``)."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns ``{"step": int, "extra": {...}}``."""
