"""One rollout sample as user code sees it, with slime's field names.

A custom generate hook (``--custom-generate-function-path``), a whole-rollout function
(``--rollout-function-path``) and a sample-level reward (``--custom-rm-path`` in slime's
``async def rm(args, sample)`` form) all read and write this type. Its contract:

- ``tokens`` = prompt ids + response ids, exactly as the engine produced them and the hook
  appended them (token in, token out: never re-tokenised from ``response``);
- ``response_length`` = ``len(tokens) - len(prompt ids)``; ``loss_mask`` and
  ``rollout_log_probs`` hold one entry per response token (``response_length`` each);
- ``loss_mask[j]`` is 1 for a token the policy produced and 0 for one it only conditions on
  (a tool's output, environment text): a 0 token is in the forward but in no loss term and in no
  count;
- ``rollout_log_probs[j]`` is the engine's log-prob of a model token (any value, 0.0 by
  convention, for a masked one);
- ``reward``: what the run's reward gave (``rewards.scorer``): a number, or a dict holding it
  under ``--reward-key``; ``get_reward_value(args)`` is the number (slime's accessor);
- ``rollout_routed_experts`` (MoE, ``--use-rollout-routing-replay``): ``[len(tokens) - 1,
  num_moe_layers, top_k]`` int, the experts the engine routed each token it ran to (every token but
  the last, which is never run; slime's and SGLang's layout, ``rl_plugin.routing``); ``None`` when
  the engine did not record them;
- ``multimodal_inputs`` / ``multimodal_train_inputs`` (slime's names; ``--multimodal-keys``): the
  prompt's images (``{"image": [PIL.Image, ...]}``, what a reward reads) and what the processor
  made of them (``{"pixel_values": [patches, C*T*P*P], "image_grid_thw": [images, 3]}``, what the
  engine and the trainer read); ``tokens`` then holds the processor's expanded ids (one
  ``<|image_pad|>`` per image token); None for a text sample;
- ``weight_versions`` (one int per response token, or None): the trainer weight version that
  produced each token (the engine's version when it generated it, beside that version's
  ``rollout_log_probs``); under fully asynchronous training with partial rollouts one sample can
  span several versions. A group's staleness is the trainer's current version minus its oldest
  token's version. None where the loop does not track versions (every token: the engine's current
  weights).

The hot path never loops over ``Sample`` objects: a rollout's samples are flattened into
``RolloutData``'s tensors once, in one pass (``rollout/flatten.py``).

``RolloutData``: one rollout as flat tensors, samples ordered by prompt group (a group's
``--n-samples-per-prompt`` samples contiguous); ``tokens`` holds prompt + response of every sample
back to back (``[sum T_i]``), ``rollout_log_probs`` the sampler's log-prob of each response token
and ``loss_mask`` its 0/1 trained flag (``[sum R_i]`` each; 0 for the ids a custom generate hook
appended, tool output: conditioned on, in no loss term and in no count). It travels from the
rollout manager to the driver (pickled with its tensors in one buffer), into a checkpoint under
overlapped training (``checkpoint.pending_rollout``), and becomes the step batch
(``loop.advantages.rollout_batch``). Under ``--use-rollout-routing-replay`` ``routed_experts`` holds,
per token of ``tokens``, per MoE layer, the ``top_k`` experts the engine routed it to
(``[sum T_i, num_moe_layers, top_k]`` int16; ``rl_plugin.routing``); the last token of each sample
never ran through the engine and holds ``UNROUTED`` (-1) rows: the trainer's router routes it
itself (its hidden state reaches no log-prob: causal attention, and its logits predict past the
sample).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs, segment_ids
from rl_plugin.loss import select_images
from rl_plugin.tensor_pickle import reduce_dataclass

Messages = List[Dict[str, Any]]


@dataclass
class Sample:
    """One prompt's one response, slime-compatible (see the module docstring for the invariants)."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"  # the engine stopped on a stop/EOS token
        TRUNCATED = "truncated"  # the response hit its length limit
        ABORTED = "aborted"  # generation was cut off (engine restart, abort); not trained on

    group_index: Optional[int] = None
    index: Optional[int] = None
    prompt: Union[str, Messages] = ""
    tokens: List[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Optional[Union[float, Dict[str, Any]]] = None
    loss_mask: Optional[List[int]] = None
    rollout_log_probs: Optional[List[float]] = None
    rollout_routed_experts: Optional[Any] = None
    weight_versions: Optional[List[int]] = None
    multimodal_inputs: Optional[Dict[str, Any]] = None  # slime's: {"image": [PIL images]} of the prompt
    multimodal_train_inputs: Optional[Dict[str, torch.Tensor]] = None  # pixel_values, image_grid_thw
    metadata: Dict[str, Any] = field(default_factory=dict)
    status: "Sample.Status" = Status.PENDING

    @property
    def prompt_length(self) -> int:
        """Number of prompt ids at the front of ``tokens``."""
        return len(self.tokens) - self.response_length

    def get_reward_value(self, config) -> float:
        """The number of ``reward`` (slime's accessor, what its filters read, called with the
        ``RolloutConfig`` filters receive as ``args``): a dict reward's entry under
        ``--reward-key`` (``"reward"`` when unset, as the scorer reads it)."""
        if isinstance(self.reward, dict):
            return self.reward[getattr(config, "reward_key", None) or "reward"]
        return self.reward


@dataclass
class RolloutData:
    """One rollout, samples ordered by prompt group. ``tokens``: prompt + response of every sample
    (``[sum T_i]``); ``rollout_log_probs``: the sampler's log-prob of each response token;
    ``loss_mask``: 1 for a token the policy produced, 0 for one it only conditions on (fp32,
    ``[sum R_i]``; None at construction means every response token is trained)."""

    tokens: torch.Tensor
    total_lengths: torch.Tensor
    response_lengths: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor]  # None: nothing sampled (an SFT batch)
    rewards: Optional[torch.Tensor]  # None: no reward (an SFT batch)
    group_ids: torch.Tensor
    num_groups: int
    stats: Dict[str, float] = field(default_factory=dict)
    examples: List[Dict[str, object]] = field(default_factory=list)
    dataset_state: Optional[Dict[str, object]] = None  # the manager's state_dict() right after this generate
    weight_load: Optional[Dict[str, Any]] = None  # the weight sync generate loaded first (``update_weights``'s answer)
    routed_experts: Optional[torch.Tensor] = None  # [sum T_i, num_moe_layers, top_k] int16 (routing replay)
    loss_mask: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None  # --use-opd with an engine-served teacher, [sum R_i]
    pixel_values: Optional[torch.Tensor] = None  # images: StepBatch's layout (``loss.batch``); None for text
    image_grid_thw: Optional[torch.Tensor] = None
    image_counts: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = torch.ones(int(self.response_lengths.sum()), dtype=torch.float32)

    def model_token_counts(self) -> torch.Tensor:
        """Per sample, its trained (model-produced) response tokens: the loss mask's sum (``[S]``,
        int64); equal to ``response_lengths`` without a custom generate hook."""
        rl = self.response_lengths.long()
        sums = torch.zeros(rl.numel(), dtype=torch.float64).index_add_(0, segment_ids(rl), self.loss_mask.double())
        return sums.round().long()

    def __reduce_ex__(self, protocol):
        """Pickled (Ray's transport from the rollout manager to the driver) with its tensors in
        one buffer (``rl_plugin.tensor_pickle``): ~0.05 ms instead of torch's ~0.7 ms for the
        six tensors of the embedded rollout; torch's pickling when a tensor needs it."""
        return reduce_dataclass(self) or super().__reduce_ex__(protocol)

    def select_groups(self, groups: torch.Tensor, group_size: int) -> "RolloutData":
        """The rollout of the given groups (contiguous ``group_size`` samples each), renumbered
        ``0..len(groups)-1``; stats and examples are left to the caller."""
        groups = torch.as_tensor(groups, dtype=torch.long)
        idx = expand_runs(groups * group_size, torch.full_like(groups, group_size))
        images = {}
        if self.image_counts is not None:
            picked = select_images(self.pixel_values, self.image_grid_thw, self.image_counts, idx)
            images = dict(zip(("pixel_values", "image_grid_thw", "image_counts"), picked))
        tl, rl = self.total_lengths, self.response_lengths
        resp = expand_runs(exclusive_cumsum(rl)[idx], rl[idx])
        token_idx = expand_runs(exclusive_cumsum(tl)[idx], tl[idx])
        return RolloutData(
            tokens=self.tokens[token_idx],
            total_lengths=tl[idx],
            response_lengths=rl[idx],
            rollout_log_probs=self.rollout_log_probs[resp],
            rewards=self.rewards[idx],
            group_ids=torch.arange(groups.numel()).repeat_interleave(group_size),
            num_groups=int(groups.numel()),
            loss_mask=self.loss_mask[resp],
            routed_experts=None if self.routed_experts is None else self.routed_experts[token_idx],
            teacher_log_probs=None if self.teacher_log_probs is None else self.teacher_log_probs[resp],
            **images,
        )


# the fields that travel in one buffer when pickled (``tensor_pickle.reduce_dataclass``)
RolloutData.TENSOR_FIELDS = (
    "tokens",
    "total_lengths",
    "response_lengths",
    "rollout_log_probs",
    "rewards",
    "group_ids",
    "loss_mask",
    "routed_experts",
    "teacher_log_probs",
    "pixel_values",
    "image_grid_thw",
    "image_counts",
)
