"""ColocationConfig: how the rollout engines and the training ranks share devices under
``--colocate`` (docs/design.md "Colocation"): the engines' memory share, sleep between rollouts,
the training state offloaded to host memory while the engines generate, and what cannot work.

The engine's memory share is vLLM's ``gpu_memory_utilization`` (``--rollout-gpu-memory-utilization``):
the fraction of the whole GPU its weights + KV cache may take when it wakes. Disaggregated the
default is vLLM's 0.9; colocated it is ``COLOCATED_MEMORY_SHARE`` (0.5, verl's default), which
leaves the other half to the training state that stays on the device (all of it without
``--offload-train``, the activations of a step with it). SGLang's share is its own flag
(``--sglang-mem-fraction-static``, passed to the server as ``--mem-fraction-static``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs.cluster import ClusterConfig
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag, same_as
from rl_plugin.loss_config.opd import TEACHER_MEMORY_SHARE

GROUP = "cluster"
DEFAULT_MEMORY_SHARE = 0.9  # vLLM's own default: the engine alone on its GPUs
COLOCATED_MEMORY_SHARE = 0.5  # colocated: half for the engine, half for the training state
DISTRIBUTED_TRANSPORTS = ("distributed", "nccl")  # refused colocated on GPUs (one device, two NCCL ranks)


@dataclass(frozen=True)
class ColocationConfig(Declared):
    colocate: bool = same_as(ClusterConfig, "colocate")
    offload_train: bool = flag(
        "--offload-train",
        action="store_true",
        group=GROUP,
        help=(
            "With --colocate: move the training state (parameters, gradients, optimizer state, the reference model) to "
            "host memory while the rollout engines generate, and back before the train call's first forward "
            "(slime's flag). Frees the device for the engines' KV cache at the cost of two host copies per rollout; "
            "use it when the model's training state and the engine do not fit one device together."
        ),
    )
    gpu_memory_utilization: Optional[float] = flag(
        "--rollout-gpu-memory-utilization",
        type=float,
        default=None,
        group=GROUP,
        help=(
            "The fraction of each GPU a vLLM engine may take for its weights and KV cache (vLLM's "
            f"gpu_memory_utilization). Default: {DEFAULT_MEMORY_SHARE} disaggregated, {COLOCATED_MEMORY_SHARE} with "
            "--colocate (the rest stays with the training ranks). Raise it colocated with --offload-train; lower it "
            "when training runs out of memory beside a colocated engine."
        ),
    )
    sglang_mem_fraction_static: Optional[float] = flag(
        "--sglang-mem-fraction-static",
        type=float,
        default=None,
        group=GROUP,
        help=(
            "SGLang's --mem-fraction-static for its servers (weights + KV cache share of each GPU); default: SGLang's "
            "own. Lower it with --colocate so the training ranks keep room (slime uses ~0.7 colocated)."
        ),
    )

    def memory_share(self) -> float:
        """The vLLM engines' ``gpu_memory_utilization``."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return COLOCATED_MEMORY_SHARE if self.colocate else DEFAULT_MEMORY_SHARE

    def check(self, run) -> None:
        for name, value in (
            ("--rollout-gpu-memory-utilization", self.gpu_memory_utilization),
            ("--sglang-mem-fraction-static", self.sglang_mem_fraction_static),
        ):
            if value is not None and not (math.isfinite(value) and 0 < value <= 1):
                fail(name, f"is a fraction of a GPU's memory, in (0, 1] (got {value})", f"e.g. {name} 0.5")
        if self.offload_train and not self.colocate:
            fail(
                "--offload-train without --colocate",
                "the training state is offloaded so that colocated engines can use the device; disaggregated, the "
                "engines have devices of their own and the copies would only cost time",
                "add --colocate, or drop --offload-train",
            )
        if self.sglang_mem_fraction_static is not None and run.rollout.engine.engine != "sglang":
            fail(
                f"--sglang-mem-fraction-static with --rollout-engine {run.rollout.engine.engine}",
                "only SGLang's servers read it",
                "use --rollout-gpu-memory-utilization for vLLM, or drop the flag",
            )
        if not self.colocate:
            return
        engine = self.gpu_memory_utilization or COLOCATED_MEMORY_SHARE
        loss = run.train.loss
        teacher = loss.opd_teacher_gpu_memory_utilization
        if loss.use_opd and loss.opd_type == "vllm" and run.rollout.engine.engine == "vllm" and engine + teacher >= 1:
            fail(
                f"--opd-type vllm with --colocate: --rollout-gpu-memory-utilization {engine} + "
                f"--opd-teacher-gpu-memory-utilization {teacher} >= 1",
                "the teacher's vLLM lives in the rollout manager, on the GPU of engine 0 and train rank 0, and each "
                "engine takes its share of that GPU's whole memory, so both together must leave room for training",
                f"lower one of them so that they sum below 1 (the defaults: {COLOCATED_MEMORY_SHARE} + {TEACHER_MEMORY_SHARE})",
            )
        per_engine, world = run.rollout.engine.tensor_parallel_size, run.cluster.world_size
        if (
            per_engine is not None
            and per_engine > 1
            and (world % per_engine or run.cluster.actor_num_gpus_per_node % per_engine)
        ):
            fail(
                f"--colocate with --rollout-num-gpus-per-engine {per_engine} on {run.cluster.actor_num_nodes} node(s) x "
                f"--actor-num-gpus-per-node {run.cluster.actor_num_gpus_per_node}",
                "a colocated engine runs tensor-parallel over the GPUs of whole training ranks of one node, so its "
                "size must divide the training GPUs of every node",
                f"use --actor-num-gpus-per-node a multiple of {per_engine}, or a --rollout-num-gpus-per-engine that "
                f"divides {run.cluster.actor_num_gpus_per_node}",
            )
        if run.sync.transport in DISTRIBUTED_TRANSPORTS and run.cluster.placement_device == "gpu":
            refuse_colocated_nccl(run.sync.transport)


def refuse_colocated_nccl(transport: str) -> None:
    """``--colocate`` on GPUs with the broadcast transport: train rank 0 and engine 0 share a device,
    and NCCL refuses two ranks of one group on one GPU (the placement calls this once it knows the
    cluster has GPUs)."""
    fail(
        f"--colocate with --update-weight-transport {transport} on GPUs",
        "train rank 0 and a colocated engine sit on one GPU, and NCCL cannot form a group of two ranks on one "
        "device; colocated engines read the weights through host shared memory (the IPC path) instead",
        "use --update-weight-transport auto (shared memory on the node, the object store across nodes)",
    )
