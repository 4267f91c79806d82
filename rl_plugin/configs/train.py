"""TrainConfig: everything one training process needs, and the rules of ``--train-backend``."""

from __future__ import annotations

from dataclasses import dataclass

from rl_plugin.configs.batching import BatchingConfig
from rl_plugin.configs.lora import LoraConfig
from rl_plugin.configs.model import ModelConfig
from rl_plugin.configs.optimizer import OptimizerConfig
from rl_plugin.configs.routing_replay import RoutingReplaySettings
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag, nested, runtime
from rl_plugin.loss_config import LossConfig
from rl_plugin.registries import TRAIN_BACKENDS


@dataclass(frozen=True)
class TrainConfig(RoutingReplaySettings, Declared):
    """Everything one training process needs (``TrainBackend.from_config``, ``TrainActor.init``)."""

    train_backend: str = flag(
        "--train-backend",
        choices=TRAIN_BACKENDS.names,
        default="megatron",
        help="megatron: megatron-core GPTModel (TP, CP with transformer-engine, distributed optimizer). fsdp: PyTorch FSDP2 on the Hugging Face model (DP only), for models without a Megatron definition.",
        group="training backend",
    )
    model: ModelConfig = nested(ModelConfig)
    batching: BatchingConfig = nested(BatchingConfig)
    loss: LossConfig = nested(LossConfig)
    optimizer: OptimizerConfig = nested(OptimizerConfig)
    lora: LoraConfig = nested(LoraConfig)
    use_rollout_logprobs: bool = flag(  # old log-probs = the engine's (no recompute pass)
        "--use-rollout-logprobs",
        action="store_true",
        help="Use the engine's log-probs as the old log-probs and skip the trainer's recompute pass (slime): saves a forward pass per rollout when the engine and the trainer agree (e.g. true on-policy kernels); the PPO ratio then absorbs any mismatch.",
        group="off-policy correction",
    )
    freeze_vision_tower: bool = flag(
        "--freeze-vision-tower",
        action="store_true",
        help="Vision-language models: keep the vision tower (and its patch merger / projector) fixed; only the language model trains (no gradients, no optimizer state for the tower; grad_norm and --clip-grad then cover the trainable parameters only). Needs --multimodal-keys. Off by default (the tower trains); with --lora-rank the tower is frozen anyway (adapters on the language model only).",
        group="training backend",
    )
    # the critic's process (``RunConfig.critic_train``): the actor's architecture with a scalar value
    # head instead of the LM head; no flag (the run config sets it for the critic group only)
    value_head: bool = runtime(False)
    # true on-policy mode (issue 45): the backend's model and log-probs through rl_plugin.invariant
    true_on_policy: bool = runtime(False)  # no flag here: the run config sets it (--true-on-policy-mode)

    def check(self, run) -> None:
        """What each backend cannot train (the FSDP backend shards over data parallelism only)."""
        RoutingReplaySettings.check(self, run)
        if self.freeze_vision_tower and not run.rollout.multimodal.image_key:
            fail(
                "--freeze-vision-tower without --multimodal-keys",
                "it freezes a vision tower, and the run reads no images",
                'add --multimodal-keys \'{"image": "images"}\' with a vision-language --hf-checkpoint, or drop the flag',
            )
        if self.train_backend == "megatron" and self.model.fp16:
            fail(
                "--train-backend megatron with --fp16",
                "rl_plugin's Megatron backend trains in bf16 or fp32 (no fp16 loss scaling path)",
                "use --bf16 (bf16 compute, fp32 main weights and gradients)",
            )
        if self.train_backend != "fsdp":
            if self.model.attn_implementation != "sdpa":
                fail(
                    f"--fsdp-attn-implementation {self.model.attn_implementation} with --train-backend {self.train_backend}",
                    "only the FSDP backend reads it (megatron-core chooses its own attention)",
                    "drop the flag or use --train-backend fsdp",
                )
            return
        for name, value in (
            ("--tensor-model-parallel-size", self.model.tensor_model_parallel_size),
            ("--context-parallel-size", self.model.context_parallel_size),
        ):
            if value > 1:
                fail(
                    f"--train-backend fsdp with {name} {value}",
                    "the FSDP backend shards over data parallelism only",
                    f"use --train-backend megatron for {name} > 1, or set it to 1",
                )
        if self.model.pipeline_model_parallel_size > 1:
            fail(
                f"--train-backend fsdp with --pipeline-model-parallel-size {self.model.pipeline_model_parallel_size}",
                "the FSDP backend shards over data parallelism only",
                "set --pipeline-model-parallel-size 1",
            )
        if self.model.fp16:
            fail(
                "--train-backend fsdp with --fp16",
                "the FSDP backend has no loss scaler, so fp16 gradients can underflow silently",
                "use --bf16 (bf16 compute, fp32 master weights and gradient reduction)",
            )
