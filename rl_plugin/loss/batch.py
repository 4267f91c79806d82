"""StepBatch: one rank's samples for one optimizer step, full sequences (not CP-sliced).

Layout: samples are concatenated. ``tokens`` holds prompt + response of every sample
(``[sum T_i]``); every per-response-token tensor (``loss_mask``, ``advantages``, log-probs) holds
the responses only (``[sum R_i]``). ``group_ids`` are step-local prompt-group ids in
``[0, num_groups)``, the same id on every DP rank for samples of the same prompt, so a group may
straddle DP ranks. ``routed_experts`` (routing replay, ``rl_plugin.routing``) is per token of
``tokens``: ``[sum T_i, num_moe_layers, top_k]`` int. ``teacher_log_probs`` (``--use-opd``) is
per response token, like the reference log-probs; so are the critic's ``values`` (its
predictions before the update) and ``returns`` (GAE targets) of a value step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs, segment_ids
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.tensor_pickle import reduce_dataclass

PER_TOKEN_FIELDS = (
    "loss_mask",
    "advantages",
    "old_log_probs",
    "ref_log_probs",
    "rollout_log_probs",
    "teacher_log_probs",
    "values",
    "returns",
)


@dataclass
class StepBatch:
    tokens: torch.Tensor
    total_lengths: torch.Tensor
    response_lengths: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None  # --use-opd: the teacher's log-prob of each response token
    routed_experts: Optional[torch.Tensor] = None
    # each sample's index in its rollout (``loop.advantages.rollout_batch``), carried through the
    # steps' and ranks' selections so that a report can name a sample of the rollout
    sample_index: Optional[torch.Tensor] = None
    # PPO with a critic (``value_step``): the critic's values before its update ("old values") and
    # the GAE returns (its targets), fp32 per response token
    values: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None

    @property
    def num_samples(self) -> int:
        return int(self.total_lengths.numel())

    def __reduce_ex__(self, protocol):
        """Pickled (Ray's transport of a batch to the train actors) as one buffer of all its
        tensors (``rl_plugin.tensor_pickle``: ~0.02 ms instead of torch's ~40 us per tensor each
        way; only the viewed elements of a view travel). A tensor that needs torch's pickling
        (off the CPU, requiring grad) keeps it for the whole batch."""
        return reduce_dataclass(self) or super().__reduce_ex__(protocol)

    def response_sample_ids(self) -> torch.Tensor:
        """Sample index of every response token, ``[sum R_i]``."""
        return segment_ids(self.response_lengths)

    def validate(self) -> "StepBatch":
        """Raise ``BadBatchError`` naming the first bad sample; returns self when valid.

        An empty local batch is allowed here (a DP rank may get no sample in a step); an empty
        *global* step is rejected by the step counts.
        """
        s = self.num_samples
        for name in ("response_lengths", "group_ids") + (() if self.sample_index is None else ("sample_index",)):
            if getattr(self, name).numel() != s:
                raise BadBatchError(f"{name} has {getattr(self, name).numel()} entries for {s} samples (total_lengths)")
        neg = torch.nonzero(self.response_lengths < 0).flatten()
        if neg.numel():
            raise BadBatchError(f"sample {int(neg[0])}: negative response_length {int(self.response_lengths[neg[0]])}")
        short = torch.nonzero(self.total_lengths - self.response_lengths < 1).flatten()
        if short.numel():
            i = int(short[0])
            raise BadBatchError(
                f"sample {i}: total_length={int(self.total_lengths[i])} leaves no prompt token for "
                f"response_length={int(self.response_lengths[i])}"
            )
        if self.tokens.numel() != int(self.total_lengths.sum()):
            raise BadBatchError(
                f"tokens has {self.tokens.numel()} entries but total_lengths sum to {int(self.total_lengths.sum())}"
            )
        if self.routed_experts is not None and self.routed_experts.shape[0] != self.tokens.numel():
            raise BadBatchError(
                f"routed_experts has {self.routed_experts.shape[0]} entries but tokens has {self.tokens.numel()}"
            )
        n_resp = int(self.response_lengths.sum())
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if value.shape[0] != n_resp:
                raise BadBatchError(
                    f"{name} has {value.shape[0]} entries but response_lengths sum to {n_resp}: "
                    f"{self._first_mismatch(value.shape[0])}"
                )
            if value.is_floating_point():
                bad = ~torch.isfinite(value)
                if name == "loss_mask":
                    bad = bad | (value < 0)
                if bool(bad.any()):
                    tok = int(torch.nonzero(bad).flatten()[0])
                    i = int(self.response_sample_ids()[tok])
                    j = tok - int(exclusive_cumsum(self.response_lengths.long())[i])
                    raise BadBatchError(f"sample {i}: {name}[{j}] = {value[tok].item()} is not a finite valid value")
        if self.group_ids.numel() and int(self.group_ids.min()) < 0:
            i = int(torch.nonzero(self.group_ids < 0).flatten()[0])
            raise BadBatchError(f"sample {i}: group_id {int(self.group_ids[i])} < 0")
        return self

    def _first_mismatch(self, n: int) -> str:
        ends = torch.cumsum(self.response_lengths.long(), 0)
        over = torch.nonzero(ends > n).flatten()
        if over.numel():
            return f"the tensor ends inside sample {int(over[0])}"
        return f"the tensor runs past the last sample ({self.num_samples - 1})"

    def select(self, sample_index: torch.Tensor) -> "StepBatch":
        """The sub-batch of the given samples (in that order), all per-token tensors gathered."""
        sample_index = torch.as_tensor(sample_index, dtype=torch.long)
        tl, rl = self.total_lengths.long(), self.response_lengths.long()
        tok_idx = expand_runs(exclusive_cumsum(tl)[sample_index], tl[sample_index])
        resp_idx = expand_runs(exclusive_cumsum(rl)[sample_index], rl[sample_index])
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name in ("tokens", "routed_experts"):
                out[f.name] = v[tok_idx]
            elif f.name in PER_TOKEN_FIELDS:
                out[f.name] = v[resp_idx]
            else:
                out[f.name] = v[sample_index]
        return replace(self, **out)


StepBatch.TENSOR_FIELDS = tuple(f.name for f in fields(StepBatch))  # all of them (``reduce_dataclass``)
