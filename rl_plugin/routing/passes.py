"""Which routing each pass of a backend runs under routing replay, and what it reports.

``TrainConfig.routing_replay`` (``rl_plugin.arguments.routing_replay``):

- ``"rollout"`` (R3): every pass (old, reference, training) replays the rollout's recorded
  experts (``StepBatch.routed_experts``); a rollout without them is an error.
- ``"old"`` (R2): the actor's forward-only pass (the old log-probs) records its routing into
  ``StepBatch.routed_experts``; the training passes replay it. When the training forward itself
  gives the old log-probs (one step per rollout, ``runner.old_log_probs_rule``), nothing is
  recorded and nothing replayed: that forward IS the old policy's routing. The reference pass
  (another model) routes freely.

A backend builds the pass's ``RoutingPass`` (Megatron: ``backends.megatron.routing_replay``;
FSDP: ``backends.fsdp.routing_replay``); its forward enters ``routing_pass.context`` per
micro-batch. The training pass reports ``routing/topk_agree_frac``: over the routed response
tokens of the step (every response token but each sample's last) and every MoE layer, the
fraction whose router's own top-k set equals the replayed one, summed over the DP x CP ranks.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from rl_plugin.parallel import all_reduce
from rl_plugin.routing.layout import AgreementCounter, pad_experts


def routing_action(mode: Optional[str], routed: Optional[torch.Tensor], *, role: str, training: bool) -> Optional[str]:
    """``"replay"``, ``"record"`` or None (route freely) for one pass (module docstring)."""
    if mode is None:
        return None
    if mode == "rollout":
        if routed is None:
            raise ValueError(
                "--use-rollout-routing-replay: the rollout carries no routed experts (the engine recorded none); "
                "check --rollout-engine hf and an MoE --hf-checkpoint"
            )
        return "replay"
    if mode != "old":
        raise ValueError(f"unknown routing replay mode {mode!r}")
    if role != "actor":
        return None
    if routed is not None:
        return "replay"
    return None if training else "record"


def assemble_recorded(records: List[Tuple[torch.Tensor, torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """``[num_tokens, layers, k]`` int16 from the forward-only pass's ``(step token index,
    recorded experts)`` pairs (``runner.log_probs``'s ``routing_sink``); tokens no rank of this
    process routed (another CP rank's chunks) hold ``pad_experts``."""
    layers, top_k = records[0][1].shape[1:]
    routed = pad_experts(num_tokens, layers, top_k)
    for tokens, experts in records:
        routed[tokens] = experts.to(torch.int16)
    return routed


def agreement_metrics(counter: AgreementCounter, group) -> Dict[str, float]:
    """``{"routing/topk_agree_frac": ...}`` summed over ``group`` (DP x CP), identical on every rank."""
    counts = torch.tensor([counter.agree, counter.total], dtype=torch.float64)
    all_reduce(counts, group)
    agree, total = counts.tolist()
    return {"routing/topk_agree_frac": agree / total if total else float("nan")}
