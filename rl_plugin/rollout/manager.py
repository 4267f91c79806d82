"""The rollout manager: one engine fleet and one source, composed.

One instance lives in a Ray actor (``rl_plugin.ray.rollout_actor``). It builds, once:

- the engine fleet (``fleet.EngineFleet``): the single ``hf`` engine in this process, or the engine
  actors (``rl_plugin.ray.engine_actor``), all built from the run's ``EngineConfig``; loading
  weights, pausing, sleeping / waking;
- the generation parts (``generation.source.GenerationSource``): the tokenizer, the prompt queue
  (``data.prompt_queue``), the reward (``SampleScorer``), the user's hooks, the OPD teacher, the
  agent program;
- the run's source (``source.make_source``, of the kind the run picked): the generation source
  itself (synchronous and overlapped runs) or the fully-async one (``fully_async.source``),
  which generates through the same parts.

Every call of the driver is then one call on the fleet or the source: ``generate`` (rollout k, a
weight sync loaded first), ``evaluate``, ``update_weights``, ``state_dict`` /
``load_state_dict`` (the data position), ``abort`` (on the actor's ``control`` thread).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from rl_plugin.configs import RolloutConfig
from rl_plugin.rollout import abort
from rl_plugin.rollout.data.dataset import PromptDataset
from rl_plugin.rollout.data.prompt_queue import PromptQueue
from rl_plugin.rollout.data.vl_prompt import rollout_prompts
from rl_plugin.rollout.engines.base import make_engine
from rl_plugin.rollout.fleet import EngineFleet
from rl_plugin.rollout.generation.source import GenerationSource
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.rollout.source import GENERATION, make_source
from rl_plugin.routing.hf import install_routing_flip
from rl_plugin.threads import ROLLOUT_THREADS_ENV, ThreadShare
from rl_plugin.weight_sync import SyncHandle
from rl_plugin.weight_sync.distributed import abort_waits


class RolloutManager:
    def __init__(
        self,
        config: RolloutConfig,
        checkpoint_dir: str,
        train_data: str,
        eval_data: Optional[str],
        engines: Optional[Sequence[Any]] = None,
        args: Any = None,
        threads: Optional[ThreadShare] = None,
        *,
        source: str = GENERATION,
        async_settings: Any = None,
    ):
        """``source``: the kind of ``rl_plugin.rollout.source`` (``async_settings``: the fully-async
        worker's, the run's ``AsyncConfig``); ``args``: handed to the user's hooks as slime's ``args``."""
        # the hf engine's threads when it lives here (``rl_plugin.threads``; 1 without a plan)
        (threads or ThreadShare(ROLLOUT_THREADS_ENV)).apply()
        self.config = cfg = config
        tokenizer = rollout_prompts(cfg, checkpoint_dir)  # a run with images: the processor's
        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray exposes the actor's GPU (if any) as device 0
        actors = list(engines or [])  # empty: the engine lives here
        engine = None if actors else make_engine(cfg.engine, checkpoint_dir, device=device)
        if cfg.engine.debug_routing_flip:  # test hook: an engine whose routers disagree with the trainer's
            if engine is None:
                raise ValueError(
                    "--debug-engine-routing-flip hooks the hf engine of the rollout manager's process; with engine "
                    "actors (--rollout-num-gpus) there is none. Fix: drop --rollout-num-gpus or the hook"
                )
            install_routing_flip(engine.model, cfg.engine.debug_routing_flip)
        self.fleet = EngineFleet(engine, actors, colocated=cfg.engine.colocation.colocate)
        self.fleet.sleep()  # colocated: the training ranks start beside sleeping engines
        keys = (cfg.input_key, cfg.label_key, cfg.metadata_key)
        images = cfg.multimodal.image_key  # --multimodal-keys
        train = PromptDataset.from_file(train_data, *keys, image_key=images, shuffle=cfg.rollout_shuffle, seed=cfg.seed)
        held_out = PromptDataset.from_file(eval_data, *keys, image_key=images) if eval_data else None
        self.generation = GenerationSource(
            cfg,
            checkpoint_dir,
            tokenizer,
            self.fleet,
            PromptQueue(train),
            held_out,
            hook_args=args if args is not None else config,
            device=device,
        )
        self.source = make_source(source, generation=self.generation, fleet=self.fleet, async_settings=async_settings)

    # -- the driver's calls --------------------------------------------------------------------------
    def generate(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> RolloutData:
        """Rollout ``rollout_id`` from the run's source (generated; fully async: taken from the
        worker's buffer); ``handle`` (the trainer's newest published weights, or None) loaded first
        and answered in ``data.weight_load``."""
        return self.source.rollout(rollout_id, handle)

    def evaluate(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> Dict[str, Any]:
        """The eval metrics on the held-out prompts; a given ``handle`` is loaded first and its load
        answered under ``weight_load``. Fully async: the worker waits at a token boundary."""
        return self.source.evaluate(rollout_id, handle)

    def update_weights(self, handle: SyncHandle, version: Optional[int] = None) -> Dict[str, Any]:
        """Load the sync behind ``handle`` (``rl_plugin.weight_sync``; the weights of trainer
        version ``version``: the version fully async labels the next tokens with) into every
        engine, in place; returns the bytes per engine, the slowest engine's seconds and, under
        --check-weight-sync, every engine's fingerprint (``fingerprints``)."""
        return self.fleet.load(handle, version)

    def engine_node_ids(self) -> List[str]:
        return self.fleet.node_ids()

    def abort(self) -> Optional[str]:
        """Abort the rollout in progress (``rl_plugin.rollout.abort``; called on the actor's
        ``control`` thread while ``generate`` runs on its own): the engine actors' generations
        too. Returns what was running (None: nothing)."""
        self.fleet.abort()
        abort_waits()  # a distributed load waiting for the train call ends too
        return abort.request()

    def stop(self) -> None:
        """End the fully-async worker, if any (after its submission in flight)."""
        stop = getattr(self.source, "stop", None)
        if stop is not None:
            stop()

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The data position (fully async: with the prompts taken but not trained on,
        ``async_requeue``, which a resumed run generates again first)."""
        return self.source.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.source.load_state_dict(state)
