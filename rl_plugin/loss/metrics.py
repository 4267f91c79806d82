"""Step metrics (``--pg-metrics``), reduced once per step over the DP x CP group.

Three kinds of accumulator, each reduced with its own identity so that a rank (or micro-batch)
without data cannot spoil the result:

- sums (SUM, identity 0): sample-mean-weighted sums (so the global sum IS the sample mean) and
  plain token sums (ratio sum, squared sum);
- maxes (MAX, identity -inf) and mins (MIN, identity +inf): min is reduced as MAX of -x, so
  both travel in one all-reduce.

TP ranks hold replicas and are not reduced over. Values that stay at an identity (no data on
any rank) are reported as None.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.distributed as dist

from rl_plugin.parallel import ParallelState, all_reduce


class MetricAccumulator:
    def __init__(self) -> None:
        self.sums: Dict[str, torch.Tensor] = {}
        self.maxes: Dict[str, torch.Tensor] = {}
        self.mins: Dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().to(torch.float64).reshape(())
        self.sums[name] = self.sums.get(name, torch.zeros((), dtype=torch.float64)) + v

    def add_max(self, name: str, values: torch.Tensor) -> None:
        v = values.detach().to(torch.float64).reshape(-1)
        cur = self.maxes.get(name, torch.tensor(-math.inf, dtype=torch.float64))
        self.maxes[name] = torch.maximum(cur, v.max()) if v.numel() else cur

    def add_min(self, name: str, values: torch.Tensor) -> None:
        v = values.detach().to(torch.float64).reshape(-1)
        cur = self.mins.get(name, torch.tensor(math.inf, dtype=torch.float64))
        self.mins[name] = torch.minimum(cur, v.min()) if v.numel() else cur

    def reduce(self, ps: ParallelState, names_sum=None, names_max=None, names_min=None) -> Dict[str, Optional[float]]:
        """One SUM and one MAX all-reduce over DP x CP. ``names_*`` fix the key set so that a
        rank which saw no micro-batch still joins the collective with matching shapes."""
        names_sum = sorted(set(names_sum or ()) | set(self.sums))
        names_max = sorted(set(names_max or ()) | set(self.maxes))
        names_min = sorted(set(names_min or ()) | set(self.mins))
        sums = torch.stack([self.sums.get(k, torch.zeros((), dtype=torch.float64)) for k in names_sum]) if names_sum else torch.zeros(0, dtype=torch.float64)
        ext = torch.stack(
            [self.maxes.get(k, torch.tensor(-math.inf, dtype=torch.float64)) for k in names_max]
            + [-self.mins.get(k, torch.tensor(math.inf, dtype=torch.float64)) for k in names_min]
        ) if (names_max or names_min) else torch.zeros(0, dtype=torch.float64)
        all_reduce(sums, ps.dp_cp_group)
        all_reduce(ext, ps.dp_cp_group, dist.ReduceOp.MAX)
        out: Dict[str, Optional[float]] = {k: float(v) for k, v in zip(names_sum, sums.tolist())}
        for k, v in zip(names_max, ext[: len(names_max)].tolist()):
            out[k] = v if math.isfinite(v) else None
        for k, v in zip(names_min, ext[len(names_max) :].tolist()):
            out[k] = -v if math.isfinite(v) else None
        return out
