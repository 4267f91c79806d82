"""Megatron-LM's MoE router losses on the Hugging Face MoE model (the FSDP backend), so
``--moe-aux-loss-coeff`` / ``--moe-z-loss-coeff`` add the same terms on both backends.

The router logits come from a forward hook on every MoE block's router (``block.gate``: the
first output, ``[tokens, E]``), only while ``capture`` is on (a training forward of a real
micro-batch), and only the rows of real tokens (a padded-grid micro-batch also routes padding).
Per MoE layer l, over the micro-batch's T tokens (megatron-core 0.16.1 ``moe_utils``, ``router.py``):

    p = softmax(logits, fp32);  c_e = #tokens whose top-k (of p) holds expert e
    aux_l = E / (k T^2) * sum_e c_e * sum_t p_te          (switch_load_balancing_loss_func)
    z_l   = mean_t logsumexp(logits_t)^2                   (z_loss_func)

The micro-batch's term is ``aux_coeff * sum_l aux_l + z_coeff * sum_l z_l``; the backend adds it
to the micro-batch's objective divided by ``M * dp`` (this rank's micro-batches times DP: the
mean over micro-batches and ranks, as Megatron-LM scales it). The logged values (``moe_<name>``)
are the mean over layers, without the coefficient, averaged over micro-batches and DP ranks.
HF's own ``aux_loss`` (one switch loss over all layers' tokens pooled) is another number.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

LOAD_BALANCING = "load_balancing_loss"
Z_LOSS = "z_loss"


def moe_blocks(model) -> List[torch.nn.Module]:
    """The MoE blocks of an HF model: a ``gate`` (the router) beside ``experts``."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts") and hasattr(m.gate, "weight")]


def layer_losses(logits: torch.Tensor, top_k: int) -> Dict[str, torch.Tensor]:
    """``aux_l`` and ``z_l`` (module docstring) of one layer's router logits ``[T, E]``."""
    t, e = logits.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    counts = torch.zeros(e, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, torch.topk(probs, top_k, dim=-1).indices.reshape(-1), probs.new_ones(t * top_k))
    aux = (probs.sum(0) * counts).sum() * (e / (top_k * t * t))
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return {LOAD_BALANCING: aux, Z_LOSS: z}


class RouterLosses:
    """The hooks and the per-step bookkeeping (module docstring)."""

    def __init__(self, model, *, top_k: int, aux_coeff: float, z_coeff: Optional[float]):
        self.top_k, self.aux_coeff, self.z_coeff = int(top_k), float(aux_coeff), z_coeff
        self.names = ([LOAD_BALANCING] if self.aux_coeff > 0 else []) + ([Z_LOSS] if z_coeff is not None else [])
        self.capture = False
        self.rows: Optional[torch.Tensor] = None  # real-token rows of the flattened input (None: all)
        self.logits: List[torch.Tensor] = []
        self.sums: List[torch.Tensor] = []  # per micro-batch metric vectors (device, detached)
        for block in moe_blocks(model):
            block.gate.register_forward_hook(self._hook)

    @classmethod
    def for_model(cls, model, moe) -> Optional["RouterLosses"]:
        """None unless the model is MoE and a router loss is on (``moe``: ``configs.MoEConfig``)."""
        if not moe_blocks(model) or (moe.aux_loss_coeff <= 0 and moe.z_loss_coeff is None):
            return None
        return cls(
            model, top_k=model.config.num_experts_per_tok, aux_coeff=moe.aux_loss_coeff, z_coeff=moe.z_loss_coeff
        )

    def _hook(self, module, args, output):
        if self.capture:
            logits = output[0] if isinstance(output, tuple) else output
            logits = logits.reshape(-1, logits.shape[-1])
            self.logits.append(logits if self.rows is None else logits[self.rows])

    def term(self) -> torch.Tensor:
        """The captured forward's loss term (differentiable), its metrics added to the step's sums;
        clears the capture."""
        per_layer = [layer_losses(x, self.top_k) for x in self.logits]
        self.logits = []
        term = per_layer[0][LOAD_BALANCING].new_zeros(())
        totals = []
        for name in self.names:
            total = torch.stack([p[name] for p in per_layer]).sum()
            term = term + (self.aux_coeff if name == LOAD_BALANCING else self.z_coeff) * total
            totals.append(total.detach() / len(per_layer))
        self.sums.append(torch.stack(totals))  # no host sync here: summed once, in ``metrics``
        return term

    def metrics(self, num_micro_batches: int, ps) -> Dict[str, float]:
        """``moe_<name>``: the step's means over micro-batches, averaged over DP (collective); resets."""
        from rl_plugin.parallel import all_reduce

        local = torch.zeros(len(self.names), dtype=torch.float64)
        if self.sums:
            local += torch.stack(self.sums).sum(0).double().cpu()
        local /= max(num_micro_batches, 1)
        all_reduce(local, ps.dp_group)
        local /= ps.dp_size
        self.sums = []
        return {f"moe_{name}": float(v) for name, v in zip(self.names, local.tolist())}
