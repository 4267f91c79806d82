"""Model x layout rules, read from ``--hf-checkpoint``'s ``config.json`` before anything starts.

A layout the model cannot be split into fails minutes later inside an actor (megatron-core
asserts at model construction, vLLM at engine start) with a long traceback; here it is refused in
the flag checker and in the trainer's first second, naming the numbers and the nearest layouts
that work:

- Megatron tensor parallelism splits attention heads and KV groups: both divisible by
  ``--tensor-model-parallel-size``; pipeline parallelism splits the layers
  (``--pipeline-model-parallel-size``, into equal chunks per stage under the interleaved schedule's
  ``--num-layers-per-virtual-pipeline-stage``); expert parallelism the experts
  (``--expert-model-parallel-size`` where the flag exists).
- A vLLM engine's tensor parallelism (``--rollout-num-gpus-per-engine``) splits the heads too.
  That it needs GPUs is the engine config's rule (``configs.engine.check_engine_device``), decided
  by the placement from the Ray cluster's resources, never by the driver's own CUDA (a CPU head
  node with ``RAY_ADDRESS`` on a GPU cluster runs multi-GPU engines on the GPU nodes).
- A dense model: expert parallelism refused, the other MoE-only flags warned as unread
  (``rl_plugin.arguments.unread_flags.check_model_flags``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

from rl_plugin.arguments.unread_flags import check_model_flags
from rl_plugin.errors import fail
from rl_plugin.models.experts import num_experts
from rl_plugin.parallel import virtual_pipeline_size


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split(flag: str, size: int, what: str, count: int, config: Path) -> None:
    if size > 1 and count % size != 0:
        fail(
            f"{flag} {size} with {config}",
            f"the model has {count} {what}, which {size} ranks cannot split evenly",
            f"use a size that divides {count}: one of {', '.join(map(str, _divisors(count)))}",
        )


def check_model_layout(args) -> None:
    path = Path(args.hf_checkpoint) / "config.json" if args.hf_checkpoint else None
    if path is None or not path.is_file():
        return
    cfg = json.loads(path.read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}  # multimodal configs keep the language model's sizes inside
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    layers = cfg.get("num_hidden_layers")
    experts = num_experts(cfg)
    check_model_flags(args, cfg, path, experts)
    if args.train_backend == "megatron":
        if heads:
            _split("--tensor-model-parallel-size", args.tensor_model_parallel_size, "attention heads", heads, path)
            _split("--tensor-model-parallel-size", args.tensor_model_parallel_size, "KV heads", kv, path)
        if layers:
            _split("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, "layers", layers, path)
            virtual_pipeline_size(
                layers,
                args.pipeline_model_parallel_size,
                layers_per_chunk=getattr(args, "num_layers_per_virtual_pipeline_stage", None),
                chunks_per_rank=getattr(args, "num_virtual_stages_per_pipeline_rank", None),
            )
        ep = getattr(args, "expert_model_parallel_size", 1) or 1
        if experts:
            _split("--expert-model-parallel-size", ep, "experts", experts, path)
            if args.pipeline_model_parallel_size > 1:
                fail(
                    f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} with {path}",
                    f"the model has {experts} experts, and the Megatron backend does not yet run MoE layers inside a "
                    "pipeline",
                    "use --pipeline-model-parallel-size 1 (--expert-model-parallel-size splits the experts)",
                )
    if args.rollout_engine == "vllm" and args.rollout_num_gpus_per_engine > 1:
        if heads:
            _split("--rollout-num-gpus-per-engine", args.rollout_num_gpus_per_engine, "attention heads", heads, path)
