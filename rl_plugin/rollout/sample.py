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
- ``weight_versions`` (one int per response token, or None): the trainer weight version that
  produced each token (the engine's version when it generated it, beside that version's
  ``rollout_log_probs``); under fully asynchronous training with partial rollouts one sample can
  span several versions. A group's staleness is the trainer's current version minus its oldest
  token's version. None where the loop does not track versions (every token: the engine's current
  weights).

The hot path never loops over ``Sample`` objects: a rollout's samples are flattened into
``RolloutData``'s tensors once, in one pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

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
