"""LoRA adapters on megatron-core's tensor-parallel linears (issue 34): the modules and their math.

A targeted linear W (out x in) computes ``y = W x + s * B (A dropout(x))`` with ``s = alpha / r``,
one A/B pair per Hugging Face projection (``q_proj``, ``k_proj``, ``v_proj`` inside the fused
``linear_qkv``; ``gate_proj``, ``up_proj`` inside ``linear_fc1``; ``o_proj`` = ``linear_proj``,
``down_proj`` = ``linear_fc2``), so the adapters are PEFT's on the HF model, whatever the layout.

Tensor parallelism (the product equals the unsharded one):

- Column-parallel (``linear_qkv``, ``linear_fc1``; the input is replicated over TP, the output
  split by rows): A (r x in) is replicated; B is split by output rows, rank t holding rows
  ``B.chunk(tp)[t]`` of each projection (contiguous: for q/k/v the rows of rank t's query
  groups, for gate/up its share of the FFN). ``h = A x`` is the same on every TP rank, and each
  rank's ``B_t h`` only feeds its own output rows, so dL/dh is a sum over the TP ranks:
  ``copy_to_tensor_model_parallel_region`` (forward identity, backward all-reduce) on ``h``
  makes A's gradient (and the adapter's share of dL/dx) the full one on every rank.
- Row-parallel (``linear_proj``, ``linear_fc2``; the input is split by columns): A is split by
  input columns (``A.chunk(tp, dim=1)[t]``), B (out x r) is replicated; the r-dim partial
  products are summed by ``reduce_from_tensor_model_parallel_region`` (forward all-reduce,
  backward identity), so ``h = A x`` is whole and ``B h`` equals on every rank, like the base output.

Megatron's fused output layout (``FusedLayout``): ``linear_qkv`` interleaves per query group,
``[q of the group's heads (heads/groups x head_dim), k (head_dim), v (head_dim)]`` per group,
each TP rank holding ``groups / tp`` whole groups; ``linear_fc1`` is ``[gate; up]`` per TP shard
(mbridge ``_weight_to_mcore_format`` / ``_weight_split_across_tp``, megatron-core 0.16.1). The
adapter's per-projection outputs are placed into that layout (``FusedLayout.place``); an
untargeted projection of a fused linear contributes zeros.

Gradient bookkeeping: a TP-split adapter tensor carries megatron's ``tensor_model_parallel``
attributes (the grad norm counts each shard once), a replicated one carries none (counted on TP
rank 0 only, as megatron counts its replicated weights).

Dropout (``--lora-dropout``) is drawn from torch's default generator on the adapter's input; with
dropout > 0 the loss is not layout-invariant (TP ranks draw their own masks) and the training
forward is not the eval forward (``deterministic_forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from rl_plugin.lora.init import initial_lora_a, initial_lora_b
from rl_plugin.lora.scaling import lora_scaling


@dataclass(frozen=True)
class FusedLayout:
    """One TP shard's output rows of a fused linear: ``groups`` repeats of the projections'
    widths side by side (``linear_qkv``: groups = query groups per rank, widths = (q, k, v) rows
    per group; ``linear_fc1``: 1 group, widths = (gate, up) rows per rank; unfused: 1, (out,))."""

    groups: int
    widths: Tuple[int, ...]

    def place(self, parts: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """``parts[p]``: ``[..., groups * widths[p]]`` (None: zeros) -> ``[..., groups * sum(widths)]``."""
        ref = next(p for p in parts if p is not None)
        lead = ref.shape[:-1]
        pieces = [
            (p if p is not None else ref.new_zeros(*lead, self.groups * w)).reshape(*lead, self.groups, w)
            for p, w in zip(parts, self.widths)
        ]
        return torch.cat(pieces, dim=-1).reshape(*lead, self.groups * sum(self.widths))


@dataclass(frozen=True)
class AdapterSpec:
    """One projection's adapter: its canonical names, its slot in the fused layout, its full shape."""

    projection: str  # HF leaf name, e.g. "q_proj"
    a_name: str  # canonical PEFT name of A
    b_name: str
    slot: int  # index of the projection in the linear's FusedLayout
    in_features: int  # full (unsharded)
    out_features: int  # full (unsharded)


class LoraAdapters(torch.nn.Module):
    """The A/B pairs of one megatron linear (``parallel`` "column" or "row"), on this TP rank.

    Parameters ``lora_A_<proj>`` / ``lora_B_<proj>``: column-parallel A ``[r, in]`` whole and B
    ``[out / tp, r]`` (rank's rows); row-parallel A ``[r, in / tp]`` (rank's columns) and B
    ``[out, r]`` whole. ``enabled`` False turns the adapter off (the reference model's forward)."""

    def __init__(
        self,
        specs: Sequence[AdapterSpec],
        layout: FusedLayout,
        *,
        parallel: str,
        rank: int,
        alpha: float,
        dropout: float,
        seed: int,
        tp_rank: int,
        tp_size: int,
        tp_group,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(parallel)
        self.specs, self.layout, self.parallel = tuple(specs), layout, parallel
        self.rank, self.scaling = rank, lora_scaling(alpha, rank)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.enabled = True
        for spec in self.specs:
            a = initial_lora_a(spec.a_name, rank, spec.in_features, seed)
            b = initial_lora_b(rank, spec.out_features)
            self.register_parameter(f"lora_A_{spec.projection}", self._param(a, "A", dtype, device))
            self.register_parameter(f"lora_B_{spec.projection}", self._param(b, "B", dtype, device))

    def partition_dim(self, which: str) -> Optional[int]:
        """The dim along which ``which`` ("A" / "B") is split over TP, None if replicated."""
        if self.parallel == "column":
            return 0 if which == "B" else None
        return 1 if which == "A" else None

    def local_slice(self, full: torch.Tensor, which: str) -> torch.Tensor:
        """This TP rank's part of a full adapter tensor."""
        dim = self.partition_dim(which)
        return full if dim is None or self.tp_size == 1 else full.chunk(self.tp_size, dim=dim)[self.tp_rank]

    def _param(self, full: torch.Tensor, which: str, dtype, device) -> torch.nn.Parameter:
        param = torch.nn.Parameter(self.local_slice(full, which).to(dtype=dtype, device=device).contiguous())
        dim = self.partition_dim(which)
        if dim is not None:
            set_tensor_model_parallel_attributes(param, True, dim, 1)
        return param

    def pairs(self) -> List[Tuple[AdapterSpec, torch.nn.Parameter, torch.nn.Parameter]]:
        return [
            (s, getattr(self, f"lora_A_{s.projection}"), getattr(self, f"lora_B_{s.projection}")) for s in self.specs
        ]

    def named_adapters(self) -> List[Tuple[str, torch.nn.Parameter, str]]:
        """``(canonical name, local parameter, "A"/"B")`` in spec order, A before B."""
        out = []
        for spec, a, b in self.pairs():
            out += [(spec.a_name, a, "A"), (spec.b_name, b, "B")]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``s * B (A dropout(x))`` in the linear's (local, fused) output layout."""
        x = self.dropout(x)
        pairs = self.pairs()
        h = torch.cat([F.linear(x, a) for _, a, _ in pairs], dim=-1)  # [..., P * r]
        if self.parallel == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)  # backward: dh summed over TP
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)  # forward: A x summed over TP
        parts: List[Optional[torch.Tensor]] = [None] * len(self.layout.widths)
        for (spec, _, b), h_p in zip(pairs, h.split(self.rank, dim=-1)):
            parts[spec.slot] = F.linear(h_p, b)
        return self.layout.place(parts) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``s * B A`` in the local weight's layout and dtype (the merged-weight export):
        column-parallel ``[out / tp, in]``, row-parallel ``[out, in / tp]``; computed in fp32."""
        parts: List[Optional[torch.Tensor]] = [None] * len(self.layout.widths)
        for spec, a, b in self.pairs():
            parts[spec.slot] = (b.float() @ a.float()).t()  # [in_local, out_p_local]: rows placed on the last dim
        return (self.layout.place(parts).t() * self.scaling).contiguous()


def _extra_delta(module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out + module.lora(x) if module.lora.enabled else out


class LoraColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's ``ColumnParallelLinear`` plus ``self.lora`` (``LoraAdapters``, column);
    the base weight and its state-dict names are the base class's."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        return _extra_delta(self, out, input_), bias


class LoraRowParallelLinear(RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` plus ``self.lora`` (``LoraAdapters``, row)."""

    def forward(self, input_):
        out, bias = super().forward(input_)
        return _extra_delta(self, out, input_), bias


LORA_CLASSES = {ColumnParallelLinear: LoraColumnParallelLinear, RowParallelLinear: LoraRowParallelLinear}
