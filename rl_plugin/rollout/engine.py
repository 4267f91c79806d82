"""The generation-engine interface the rollout manager drives, and the factory by name.

An engine turns prompt token ids into sampled responses with per-token log-probs at the rollout
temperature, and accepts new weights (Hugging Face names) after every train step. ``hf`` runs
Hugging Face ``generate`` in-process (CPU or one GPU). ``sglang`` / ``vllm`` are server engines
for real clusters; they are not bundled and fail loud when requested and not installed.
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch


@dataclass
class Generation:
    """One sampled response: ``response_ids`` (up to and including ``<eos>`` if it was emitted)
    and the sampler's log-prob of each of them (``log_probs``, same length)."""

    prompt_ids: List[int]
    response_ids: List[int]
    log_probs: List[float]
    finished: bool


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: Sequence[List[int]], params: SamplingParams, *, seed: int) -> List[Generation]:
        """Sample one response per entry of ``prompts`` (repeat a prompt for several samples);
        deterministic for a given ``seed`` and weights."""

    @abc.abstractmethod
    def update_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Load the trainer's full weights (Hugging Face names)."""

    @abc.abstractmethod
    def weights(self) -> Dict[str, torch.Tensor]:
        """The weights generation uses now (for ``--check-weight-sync``)."""


SERVER_ENGINES = {"sglang": "sglang", "vllm": "vllm"}


def make_engine(name: str, checkpoint_dir: str, *, device: str = "cpu") -> RolloutEngine:
    """The engine ``--rollout-engine name`` asks for."""
    if name == "hf":
        from rl_plugin.rollout.hf_engine import HFEngine

        return HFEngine(checkpoint_dir, device=device)
    if name in SERVER_ENGINES:
        package = SERVER_ENGINES[name]
        if importlib.util.find_spec(package) is None:
            raise RuntimeError(
                f"--rollout-engine {name}: the Python package '{package}' is not installed. "
                f"Install it (pip install {package}) on the rollout nodes, or use --rollout-engine hf"
            )
        raise NotImplementedError(
            f"--rollout-engine {name}: '{package}' is installed, but rl_plugin's {name} server engine is not "
            f"implemented yet; use --rollout-engine hf"
        )
    raise ValueError(f"--rollout-engine {name!r}: unknown engine; choose hf, sglang or vllm")
