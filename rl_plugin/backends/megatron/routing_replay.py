"""Routing replay on megatron-core: each micro-batch's experts through megatron-core's ``RouterReplay``.

A model built with ``moe_enable_routing_replay`` (``setup.build_model(..., routing_replay=True)``)
has one ``RouterReplay`` per ``TopKRouter`` (megatron-core 0.16.1
``transformer/moe/router_replay.py``). Its action decides what the router's top-k is:

- ``REPLAY_FORWARD``: the target indices set by ``set_target_indices`` (``[N, k]``, the router's
  ``N`` tokens in its own order); the weights are the router's scores gathered there (softmax
  over the chosen logits for Qwen-style routers: the same weights the engine mixed with);
- ``RECORD``: its own top-k, kept in ``recorded_topk_idx``;
- ``REPLAY_BACKWARD`` (activation recompute pops ``replay_backward_list``): unused here, the
  backend does not recompute, and the list is cleared before every micro-batch.

Token order. The router sees the decoder's hidden states ``[s, b, H]`` flattened to ``[s * b]``:
thd (``b = 1``) the packed stream, plus the sequence-parallel padding segment
(``forward.model_inputs``); bshd the ``[S, len]`` rows transposed (sequence-major). Under
sequence parallelism each TP rank routes its ``s / tp`` share of the sequence. ``to_router_order``
takes ``MicroBatchInputs.routed_experts`` (sample-major, ``rl_plugin.routing.layout``) there;
``from_router_order`` brings a record back (R2; without sequence parallelism, where every TP rank
routes every token).

Positions no engine routed (padding, the SP padding segment, each sample's last token) hold
``UNROUTED`` (``rl_plugin.routing.layout``): while replaying, each RouterReplay's
``get_replay_topk`` is wrapped to route those rows by the router's own top-k, so they spread
over the experts (and EP ranks) as without replay; the forward also passes megatron-core's
``padding_mask`` (``backends.megatron.forward``), so padding is in no aux loss, z-loss or
expert-bias count.

Agreement (``routing/topk_agree_frac``): the wrapper also runs megatron-core's own top-k on the
same scores, and the fraction of
(response token, MoE layer) pairs whose own top-k set equals the replayed one is counted over the
response tokens the engine routed (every response token but each sample's last).
"""

from __future__ import annotations

import contextlib
import types
from typing import Iterator, List, Optional

import torch

from rl_plugin.routing.hf import same_sets
from rl_plugin.routing.layout import UNROUTED, AgreementCounter, own_where_unrouted


def routers_of(model) -> List[torch.nn.Module]:
    """The megatron-core ``TopKRouter`` modules of ``model`` (any wrappers), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def replays_of(model) -> list:
    """Their ``RouterReplay`` objects; raises if the model was built without routing replay."""
    routers = routers_of(model)
    if not routers:
        raise ValueError("routing replay: the Megatron model has no MoE router (a dense model)")
    replays = [r.router_replay for r in routers]
    if any(r is None for r in replays):
        raise ValueError("routing replay: the Megatron model was built without moe_enable_routing_replay")
    config = routers[0].config
    if config.moe_router_fusion:  # topk_routing_with_score_function returns the fused kernel's top-k first
        raise ValueError(
            "routing replay: megatron-core's fused router (moe_router_fusion) never consults RouterReplay; "
            "build the model without it"
        )
    if config.recompute_granularity is not None:  # the recompute would need REPLAY_BACKWARD, not driven here
        raise ValueError("routing replay: activation recompute re-routes in the backward; run without recompute")
    return replays


def to_router_order(
    local: torch.Tensor, *, bshd_rows: Optional[int], extra: int, sp_rank: int, sp_size: int, fill=UNROUTED
):
    """``local`` (``[n_in, ...]``, sample-major input order) in the router's token order
    (module docstring): ``extra`` SP padding positions holding ``fill`` appended (thd: at the end;
    bshd: per row), bshd transposed to sequence-major, then this rank's ``1 / sp_size`` of the
    sequence."""
    tail = local.shape[1:]
    pad = local.new_full((1, *tail), fill)  # the SP padding: UNROUTED (the router's own top-k)
    if bshd_rows is None:
        if extra:
            local = torch.cat([local, pad.expand(extra, *tail)])
        seq = local.view(-1, 1, *tail)
    else:
        rows = local.view(bshd_rows, -1, *tail)
        if extra:
            rows = torch.cat([rows, pad.expand(bshd_rows, extra, *tail)], dim=1)
        seq = rows.transpose(0, 1)
    share = seq.shape[0] // sp_size
    return seq[sp_rank * share : (sp_rank + 1) * share].reshape(-1, *tail)


def from_router_order(recorded: torch.Tensor, *, bshd_rows: Optional[int], n_in: int) -> torch.Tensor:
    """Inverse of ``to_router_order`` without sequence parallelism: ``[n_in, ...]`` sample-major."""
    tail = recorded.shape[1:]
    if bshd_rows is None:
        return recorded[:n_in]
    return recorded.view(-1, bshd_rows, *tail).transpose(0, 1)[:, : n_in // bshd_rows].reshape(-1, *tail)


def _replaying_topk(replay, agree_out: Optional[List[torch.Tensor]]):
    """``replay.get_replay_topk`` for ``REPLAY_FORWARD``: megatron-core's (the target indices and
    the scores gathered there), except that ``UNROUTED`` rows (padding, unrun tokens) take the
    router's own top-k on the same scores; with ``agree_out``, also appends ``[N]`` bool (own set
    == replayed set). Other actions: megatron-core's own method."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    original = type(replay).get_replay_topk

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if default_compute_topk is None or self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return original(self, scores, topk, num_groups, group_topk, default_compute_topk)
        with torch.no_grad():
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        top = own_where_unrouted(self.target_topk_idx, own)
        if agree_out is not None:
            agree_out.append(same_sets(own, top))
        return scores.gather(1, top), top

    return types.MethodType(get_replay_topk, replay)


@contextlib.contextmanager
def replaying(model, routed: torch.Tensor, agree_out: Optional[List[torch.Tensor]] = None) -> Iterator[None]:
    """Within the block the model's routers route their tokens to ``routed`` (``[N, layers, k]``,
    router order: ``to_router_order``; ``UNROUTED`` rows: the router's own top-k); ``agree_out``
    (if given) receives one ``[N]`` bool per layer."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = replays_of(model)
    if routed.shape[1] != len(replays):
        raise ValueError(
            f"routing replay: the rollout carries {routed.shape[1]} MoE layers of routed experts, "
            f"the Megatron model has {len(replays)}"
        )
    targets = routed.long().unbind(1)
    for replay, target in zip(replays, targets):
        replay.clear_indices()
        replay.set_target_indices(target)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        replay.get_replay_topk = _replaying_topk(replay, agree_out)
    try:
        yield
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()
            replay.__dict__.pop("get_replay_topk", None)


@contextlib.contextmanager
def recording(model, out: List[torch.Tensor]) -> Iterator[None]:
    """Within the block the routers compute their own top-k and keep it; on exit ``out`` receives
    ``[N, layers, k]`` (router order) of the block's last forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = replays_of(model)
    for replay in replays:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
        out.append(torch.stack([r.get_recorded_indices() for r in replays], dim=1).detach())
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()


class RoutingPass:
    """What one pass of the backend does with routing (``step.micro_batch_forward`` enters
    ``context`` around each micro-batch's forward):

    - ``"replay"``: route to ``mb.routed_experts`` (R3's every pass, R2's training passes), and
      count the agreement of the router's own top-k on the routed response tokens;
    - ``"record"``: keep the routers' own top-k in ``mb.recorded_routing`` (R2's old pass).
    """

    def __init__(self, action: str, *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False):
        if action not in ("replay", "record"):
            raise ValueError(f"routing pass: unknown action {action!r}")
        self.action = action
        self.sp_rank, self.sp_size = (tp_rank, tp_size) if sequence_parallel else (0, 1)
        self.agreement = AgreementCounter()

    @contextlib.contextmanager
    def context(self, model, mb, qkv_format: str) -> Iterator[None]:
        from rl_plugin.backends.megatron.forward import model_inputs
        from rl_plugin.routing.layout import routed_response_mask

        ids, _, _ = model_inputs(mb, qkv_format, sp_size=self.sp_size)
        bshd_rows = None if qkv_format == "thd" else int(mb.input_ids.shape[0])
        extra = ids.shape[-1] - mb.input_ids.shape[-1]
        order = dict(bshd_rows=bshd_rows, extra=extra, sp_rank=self.sp_rank, sp_size=self.sp_size)
        if self.action == "record":
            if self.sp_size > 1:
                raise ValueError(
                    "--use-routing-replay records the old pass's routing per token; under --sequence-parallel "
                    "each TP rank routes only its share (not gathered here). Fix: drop --sequence-parallel"
                )
            out: List[torch.Tensor] = []
            with recording(model, out):
                yield
            mb.recorded_routing = from_router_order(out[0].cpu(), bshd_rows=bshd_rows, n_in=mb.input_ids.numel())
            return
        if mb.routed_experts is None:
            raise ValueError("routing replay: the micro-batch carries no routed experts (the rollout recorded none)")
        routed = to_router_order(mb.routed_experts, **order)
        agree: List[torch.Tensor] = []
        with replaying(model, routed.to(next(model.parameters()).device), agree):
            yield
        if agree:
            layout = mb.layout
            mask = routed_response_mask(layout.total_lengths, layout.response_lengths, layout.input_index)
            mask = to_router_order(mask, **order, fill=False).to(agree[0].device)
            for a in agree:
                self.agreement.add(a, mask)
