"""Recording and replaying the top-k routing of a Hugging Face mixture-of-experts model.

transformers 5 routes with one router module per MoE layer (``Qwen3MoeTopKRouter``,
``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``), called on the layer's hidden states flattened to
``[rows * seq, H]`` (row-major over the layer input ``[rows, seq, H]``) and returning
``(logits [N, E], weights [N, k], indices [N, k])``::

    p       = softmax(logits)                      (fp32)
    indices = topk(p, k)
    weights = p[indices] / sum(p[indices])         (normalised: ``norm_topk_prob``, always for Mixtral)

- ``RoutingRecorder`` (the ``hf`` engine): forward hooks that keep every call's ``indices`` and the
  ``[rows, seq]`` of the model input, assembled into ``[B, S, num_layers, k]`` per sampled row.
- ``install_routing_flip`` (``--debug-engine-routing-flip``, tests): an engine whose routers
  disagree with the trainer's on purpose.
- ``replay_routing`` (the FSDP backend, tests): forward hooks that replace each router's
  ``indices`` by given ones and recompute ``weights`` by the formula above at those indices, so
  the experts' inputs and mixing weights are what the router would give had it chosen them (rows
  no engine routed, ``UNROUTED``: the router's own top-k); they also report, per token, whether the router's own top-k (as a set) equals the replayed one.

Only the routers whose forward was read against this formula are accepted (``ROUTER_NORMALISE``);
another MoE router class is refused by name rather than replayed wrongly.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from rl_plugin.models.experts import num_experts
from rl_plugin.routing.layout import own_where_unrouted

# router class -> the attribute saying whether the top-k weights are renormalised (None: always)
ROUTER_NORMALISE = {
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": None,
}


def num_experts_of(config) -> int:
    """The routed experts per MoE layer of an HF config (0 for a dense model)."""
    return num_experts(config)


def _kind(module) -> str:
    """The router's transformers class name (FSDP2's ``fully_shard`` prefixes ``FSDP``)."""
    return type(module).__name__.removeprefix("FSDP")


def hf_routers(model) -> List[torch.nn.Module]:
    """The model's top-k routers in layer order ([] for a dense model). A router class outside
    ``ROUTER_NORMALISE`` raises, naming it."""
    routers = [m for m in model.modules() if _kind(m).endswith("TopKRouter")]
    for m in routers:
        if _kind(m) not in ROUTER_NORMALISE:
            raise ValueError(
                f"routing replay: {type(m).__name__} is not a router rl_plugin records or replays "
                f"(supported: {sorted(ROUTER_NORMALISE)})"
            )
    return routers


def routing_shape(model) -> Tuple[int, int]:
    """``(num_moe_layers, top_k)`` of an HF MoE model; raises for a dense one."""
    routers = hf_routers(model)
    if not routers:
        raise ValueError(f"routing replay: {type(model).__name__} has no mixture-of-experts router")
    return len(routers), int(routers[0].top_k)


def _normalises(router) -> bool:
    attr = ROUTER_NORMALISE[_kind(router)]
    return True if attr is None else bool(getattr(router, attr))


def router_weights(router, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The router's mixing weights ``[N, k]`` at ``indices`` (module docstring's formula, in the
    router's own op order: fp32 softmax, gather, renormalise, cast to the logits' dtype)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(1, indices)
    if _normalises(router):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: row ``i`` of ``a`` and ``b`` (``[N, k]`` expert ids) hold the same set."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values.to(a.dtype)).all(dim=-1)


class RoutingRecorder:
    """Within ``with RoutingRecorder(model) as rec:``, every forward call of ``model`` is recorded:
    the ``[rows, seq]`` of its ``input_ids`` and each router's top-k ``[rows * seq, k]``."""

    def __init__(self, model):
        self.model = model
        self.routers = hf_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no mixture-of-experts router to record")
        self.shapes: List[Tuple[int, int]] = []
        self.indices: List[List[torch.Tensor]] = []
        self._handles = []

    def __enter__(self) -> "RoutingRecorder":
        def on_call(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.shapes.append(tuple(ids.shape))
            self.indices.append([])

        def on_route(module, args, output):
            self.indices[-1].append(output[2].detach())

        self._handles = [self.model.register_forward_pre_hook(on_call, with_kwargs=True)]
        self._handles += [r.register_forward_hook(on_route) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def per_row(self, batch: int, prefill_inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[batch, S, num_layers, k]`` int16: the routed experts of every position each of the
        ``batch`` rows ran through the model, calls concatenated along the sequence. A first call
        on fewer rows (a prefill shared among a prompt's samples) is expanded by
        ``prefill_inverse`` (row ``b`` took distinct row ``prefill_inverse[b]``)."""
        parts = []
        for c, ((rows, seq), layers) in enumerate(zip(self.shapes, self.indices)):
            if len(layers) != len(self.routers):
                raise RuntimeError(f"routing record: call {c} ran {len(layers)} of {len(self.routers)} routers")
            part = torch.stack(layers, dim=1).view(rows, seq, len(layers), -1)
            if rows != batch:
                if c != 0 or prefill_inverse is None:
                    raise RuntimeError(f"routing record: call {c} ran {rows} rows, expected {batch}")
                part = part.index_select(0, prefill_inverse.to(part.device))
            parts.append(part.to(torch.int16))
        return torch.cat(parts, dim=1).cpu()


@contextlib.contextmanager
def replay_routing(routers: Sequence[torch.nn.Module], targets: Sequence[torch.Tensor]) -> Iterator[List[torch.Tensor]]:
    """Within the block, router ``l`` routes its ``N`` tokens to ``targets[l]`` (``[N, k]``, any
    int dtype; an ``UNROUTED`` row: the router's own top-k) with the weights ``router_weights``
    gives there. Yields a list that receives, per
    router call, ``[N]`` bool: whether the router's own top-k equals the target (as sets)."""
    if len(targets) != len(routers):
        raise ValueError(f"routing replay: {len(targets)} layers of routed experts for {len(routers)} MoE layers")
    agree: List[torch.Tensor] = []

    def hook_for(target):
        def replace(module, args, output):
            logits, _, own = output
            if target.shape != own.shape:
                raise ValueError(
                    f"routing replay: the router saw {tuple(own.shape)} (tokens, top_k), the replayed "
                    f"experts are {tuple(target.shape)}"
                )
            idx = own_where_unrouted(target, own)  # unrun / padding rows: the router's own top-k
            agree.append(same_sets(own, idx).detach())
            return logits, router_weights(module, logits, idx), idx

        return replace

    handles = [r.register_forward_hook(hook_for(t)) for r, t in zip(routers, targets)]
    try:
        yield agree
    finally:
        for h in handles:
            h.remove()


def install_routing_flip(model, frac: float) -> None:
    """Make ``model``'s routers disagree with an exact router on about ``frac`` of the tokens: such
    a token goes to its top ``k - 1`` and its ``(k + 1)``-th choice instead of its top-k (the
    mixing weights ``router_weights`` at those experts), as another kernel or a near tie would
    flip a real engine's choice. The tokens are picked pseudo-randomly by their own first logit
    (``frac(1000 |z_0|) < frac``), so every call of every layer flips about ``frac`` of its rows."""
    routers = hf_routers(model)
    if not routers:
        raise ValueError(f"--debug-engine-routing-flip: {type(model).__name__} has no mixture-of-experts router")
    top_k, experts = int(routers[0].top_k), int(routers[0].weight.shape[0])
    if experts <= top_k:
        raise ValueError(f"--debug-engine-routing-flip needs more experts ({experts}) than top_k ({top_k})")

    def flip(module, args, output):
        logits, _, own = output
        ranked = torch.softmax(logits.float(), dim=-1).argsort(dim=-1, descending=True)
        choice = torch.cat([ranked[:, : top_k - 1], ranked[:, top_k : top_k + 1]], dim=1)
        flipped = (torch.frac(logits[:, :1].float().abs() * 1e3) < frac).detach()
        chosen = torch.where(flipped, choice, own)
        return logits, router_weights(module, logits, chosen), chosen

    for r in routers:
        r.register_forward_hook(flip)
