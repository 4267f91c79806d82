"""The loss core's interface to a training backend: every type that crosses it.

A backend imports these from the package (``rl_plugin.loss``), never from a module of the core.

- ``MicroBatchInputs``: what a model forward needs of one micro-batch on one CP rank.
  ``MicroBatchInputs.build(sub_batch, ...)`` lays the micro-batch out (``cp.build_response_layout``)
  and takes the local ``input_ids`` and ``position_ids`` (thd: ``[sum local_len]``; bshd:
  ``[S, local_seq_len]``) and the ``targets`` predicted at each local response position
  (aligned with ``layout.logit_index``). Forward-only passes (old / reference log-probs) hand
  the backend this alone. Under routing replay also ``routed_experts`` (``rl_plugin.routing``):
  the experts of each input position, in the order of ``input_ids`` flattened.
- ``MicroBatch``: the train step's micro-batch (``StepContext.micro_batch``): the same four
  model-input fields plus the loss-side per-token slices on the loss device. A backend's forward
  reads only the four model-input fields, so it takes either.
- ``ForwardOptions``: how the forward turns rows into log-probs (temperature, vocab chunk,
  whether to compute the entropy), or, with ``values``, that the value model's scalar head gives
  the rows instead (``value_step``); the runner builds it once per pass from the ``LossConfig``
  and it travels unchanged through every hop of a backend's forward.
- ``StepBackend``: what the step runner calls (``forward``, ``schedule``, ``optimizer_step``,
  ``loss_device``); the contract of each is in ``runner``'s module docstring. ``ForwardFn`` and
  ``LossFn`` are the two callbacks the runner hands ``schedule``:
  ``forward(i) -> [n_local, 2]`` and ``loss(i, out) -> this micro-batch's share of J``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple

import torch

from rl_plugin.cp import ResponseLayout, build_response_layout
from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss_config import LossConfig
from rl_plugin.parallel import ParallelState
from rl_plugin.routing.layout import local_routed_experts

ForwardFn = Callable[[int], torch.Tensor]
LossFn = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ForwardOptions:
    """``temperature``: logits are divided by it before the log-softmax (the sampler's
    ``--rollout-temperature``); ``chunk_size``: rows per chunk of the vocab-parallel log-softmax
    (``--log-probs-chunk-size``; a fused head may lower it to its own bound); ``with_entropy``:
    compute the entropy column (zeros otherwise); ``values``: the pass runs a VALUE model (a
    backend built with ``TrainConfig.value_head``) and the forward returns ``[n_local, 1]`` fp32
    values V(s_t), one per local response token t, from the scalar head on the hidden state of
    the position that predicts t (the row whose logits give t's log-prob); temperature, chunk
    and entropy do not apply to it."""

    temperature: float
    chunk_size: int
    with_entropy: bool
    values: bool = False

    @classmethod
    def of(cls, cfg: LossConfig, *, with_entropy: bool, values: bool = False) -> "ForwardOptions":
        """The options of the loss config ``cfg`` (``with_entropy``, ``values``: the pass's choice)."""
        return cls(
            temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size, with_entropy=with_entropy, values=values
        )


@dataclass
class MicroBatchInputs:
    layout: ResponseLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    # routing replay: the experts to route each input position to (``rl_plugin.routing.layout``)
    routed_experts: Optional[torch.Tensor] = None
    # R2's record pass: the backend's forward writes the routing it computed here, same order
    recorded_routing: Optional[torch.Tensor] = None

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
            routed_experts=local_routed_experts(layout.input_index, sub_batch.routed_experts),
        )


@dataclass
class MicroBatch:
    """A micro-batch on one rank, already in the rank's CP-local order.

    ``input_ids`` / ``position_ids``: model input (thd: ``[sum local_len]``; bshd:
    ``[S, local_seq_len]``); ``targets`` and every per-token field: one entry per local response
    token, aligned with ``layout.logit_index``.
    """

    sample_index: torch.Tensor
    batch: StepBatch
    layout: ResponseLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: Optional[torch.Tensor]
    ref_log_probs: Optional[torch.Tensor]
    pg_weights: torch.Tensor
    sample_mean_weights: torch.Tensor
    sample_token_counts: torch.Tensor
    tis_weights: Optional[torch.Tensor] = None
    step_token_index: Optional[torch.Tensor] = None  # step-level index of the micro-batch's FULL responses
    local_index: Optional[torch.Tensor] = None  # step-level index of each local token (loss device)
    sample_ids: Optional[torch.Tensor] = None  # sample of each local token (loss device)
    routed_experts: Optional[torch.Tensor] = None  # as MicroBatchInputs.routed_experts
    recorded_routing: Optional[torch.Tensor] = None  # as MicroBatchInputs.recorded_routing

    @property
    def num_local_tokens(self) -> int:
        return self.layout.num_local_tokens


class StepBackend(Protocol):
    """What the runner needs from a backend (``runner``'s module docstring)."""

    parallel_state: ParallelState
    loss_device: torch.device
    loss_config: LossConfig

    def forward(self, model, inputs: MicroBatchInputs, options: ForwardOptions) -> torch.Tensor: ...

    def schedule(
        self, model, num_micro_batches: int, forward: ForwardFn, loss: LossFn, *, forward_only: bool
    ) -> int: ...

    def optimizer_step(self) -> Tuple[float, float]: ...
