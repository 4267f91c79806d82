"""Routing replay on the FSDP backend: the Hugging Face routers replay (or record) through forward
hooks (``rl_plugin.routing.hf``).

An HF MoE block routes its input ``[rows, seq, H]`` flattened row-major. ``packing.model_inputs``
lays a micro-batch out as the padded grid ``[S, L]`` (thd, ``segment_grid``: row ``s``, column
``j`` reads packed position ``gather[s, j]``), one packed row ``[1, t]`` (thd), or ``[S, len]``
rows (bshd, already sample-major like ``MicroBatchInputs.routed_experts``). ``RoutingPass`` puts
the micro-batch's routed experts in that order (grid padding cells are ``UNROUTED``: the
router routes them itself, and no real token attends to them), replays them and counts the agreement of each router's own top-k on
the routed response tokens; recording (R2's old pass) reads the grid back in packed order.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

from rl_plugin.backends.fsdp.packing import thd_as_padded_grid
from rl_plugin.cp import segment_grid
from rl_plugin.routing.hf import hf_routers, replay_routing
from rl_plugin.routing.layout import UNROUTED, AgreementCounter, routed_response_mask


class RoutingPass:
    """``"replay"`` ``mb.routed_experts`` or ``"record"`` into ``mb.recorded_routing`` (the Megatron
    backend's ``RoutingPass`` contract, on HF routers)."""

    def __init__(self, action: str, attn_implementation: str):
        if action not in ("replay", "record"):
            raise ValueError(f"routing pass: unknown action {action!r}")
        self.action, self.attn_implementation = action, attn_implementation
        self.agreement = AgreementCounter()

    def _grid(self, mb):
        """``(gather, valid)`` of the padded grid, or None when the model input is not one."""
        if mb.layout.qkv_format == "thd" and thd_as_padded_grid(mb.layout, self.attn_implementation):
            return segment_grid(mb.layout.local_cu_seqlens)
        return None

    @contextlib.contextmanager
    def context(self, model, mb) -> Iterator[None]:
        routers = hf_routers(model)
        if not routers:
            raise ValueError("routing replay: the FSDP model has no mixture-of-experts router (a dense model)")
        grid = self._grid(mb)
        if self.action == "record":
            recorded: List[torch.Tensor] = []
            handles = [r.register_forward_hook(lambda m, a, o: recorded.append(o[2].detach())) for r in routers]
            try:
                yield
            finally:
                for h in handles:
                    h.remove()
            flat = torch.stack(recorded[-len(routers) :], dim=1).cpu()
            mb.recorded_routing = flat[grid[1].flatten()] if grid is not None else flat
            return
        if mb.routed_experts is None:
            raise ValueError("routing replay: the micro-batch carries no routed experts (the rollout recorded none)")
        routed = mb.routed_experts
        layout = mb.layout
        mask = routed_response_mask(layout.total_lengths, layout.response_lengths, layout.input_index)
        if grid is not None:
            gather, valid = grid
            routed = torch.where(valid[..., None, None], routed[gather], UNROUTED).flatten(0, 1)
            mask = (mask[gather] & valid).flatten()
        device = next(model.parameters()).device
        with replay_routing(routers, routed.to(device).unbind(1)) as agree:
            yield
        for a in agree:
            self.agreement.add(a, mask.to(a.device))
