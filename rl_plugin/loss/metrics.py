"""Step metrics (``--pg-metrics``), reduced once per step over the DP x CP group.

Three kinds of accumulator, each reduced with its own identity so that a rank (or micro-batch)
without data cannot spoil the result:

- sums (SUM, identity 0): sample-mean-weighted sums (so the global sum IS the sample mean) and
  plain token sums (ratio sum, squared sum);
- maxes (MAX, identity -inf) and mins (MIN, identity +inf): min is reduced as MAX of -x, so
  both travel in one all-reduce.

TP ranks hold replicas and are not reduced over. Values that stay at an identity (no data on
any rank) are reported as None.

Device: values accumulate on the loss device (``device``) with no host synchronisation; at
``reduce`` each vector crosses to the CPU once and is reduced over the DP x CP group, which
carries CPU scalars (gloo; the CPU twin of an NCCL group, see ``rl_plugin.parallel``).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.distributed as dist

from rl_plugin.parallel import ParallelState, all_reduce


class MetricAccumulator:
    def __init__(self, device=None) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.sums: Dict[str, torch.Tensor] = {}
        self.maxes: Dict[str, torch.Tensor] = {}
        self.mins: Dict[str, torch.Tensor] = {}
        self._zero = self._const(0.0)

    def _const(self, value: float) -> torch.Tensor:
        return torch.full((), value, dtype=torch.float64, device=self.device)

    def add(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().to(self.device, torch.float64).reshape(())
        cur = self.sums.get(name)
        self.sums[name] = (self._zero if cur is None else cur) + v  # a new tensor: never aliases value

    def add_max(self, name: str, values: torch.Tensor) -> None:
        v = values.detach().to(self.device, torch.float64).reshape(-1)
        cur = self.maxes.get(name)
        if cur is None:
            cur = self._const(-math.inf)
        self.maxes[name] = torch.maximum(cur, v.max()) if v.numel() else cur

    def add_min(self, name: str, values: torch.Tensor) -> None:
        v = values.detach().to(self.device, torch.float64).reshape(-1)
        cur = self.mins.get(name)
        if cur is None:
            cur = self._const(math.inf)
        self.mins[name] = torch.minimum(cur, v.min()) if v.numel() else cur

    def reduce(self, ps: ParallelState, names_sum=None, names_max=None, names_min=None) -> Dict[str, Optional[float]]:
        """One SUM and one MAX all-reduce over DP x CP. ``names_*`` fix the key set so that a
        rank which saw no micro-batch still joins the collective with matching shapes."""
        names_sum = sorted(set(names_sum or ()) | set(self.sums))
        names_max = sorted(set(names_max or ()) | set(self.maxes))
        names_min = sorted(set(names_min or ()) | set(self.mins))
        zero, neg_inf, pos_inf = self._const(0.0), self._const(-math.inf), self._const(math.inf)
        sums = (
            torch.stack([self.sums.get(k, zero) for k in names_sum]).cpu()
            if names_sum
            else torch.zeros(0, dtype=torch.float64)
        )
        ext = (
            torch.stack(
                [self.maxes.get(k, neg_inf) for k in names_max] + [-self.mins.get(k, pos_inf) for k in names_min]
            ).cpu()
            if (names_max or names_min)
            else torch.zeros(0, dtype=torch.float64)
        )
        all_reduce(sums, ps.dp_cp_group)
        all_reduce(ext, ps.dp_cp_group, dist.ReduceOp.MAX)
        out: Dict[str, Optional[float]] = {k: float(v) for k, v in zip(names_sum, sums.tolist())}
        for k, v in zip(names_max, ext[: len(names_max)].tolist()):
            out[k] = v if math.isfinite(v) else None
        for k, v in zip(names_min, ext[len(names_max) :].tolist()):
            out[k] = -v if math.isfinite(v) else None
        return out
