"""Flags of where the loop's Ray actors run: training ranks, the rollout, and their placement."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group("cluster", "Ray placement of the training ranks and the rollout engine.")
    add_flag(g, "--actor-num-nodes", type=int, default=1, help="Nodes for the training actors.")
    add_flag(
        g,
        "--actor-num-gpus-per-node",
        type=int,
        default=1,
        help="Training processes per node, one GPU each. On a machine without GPUs it is the number of CPU training processes (gloo), e.g. 2 for DP=2 on a laptop.",
    )
    add_flag(
        g,
        "--rollout-num-gpus",
        type=int,
        default=None,
        help="GPUs for all rollout engines together when disaggregated (slime's flag; default: one engine's worth). Engines = --rollout-num-gpus / --rollout-num-gpus-per-engine; a rollout's prompt groups are spread over them. On a CPU machine each engine is one CPU process instead of GPUs.",
    )
    add_flag(
        g,
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="GPUs per rollout engine, its tensor-parallel size (slime's flag). Use more when one GPU cannot hold the model and its KV cache; use more engines (raise --rollout-num-gpus) for throughput. hf engines take 1.",
    )
    add_flag(
        g,
        "--colocate",
        action="store_true",
        help="Put the rollout engine on the training GPUs (time-shared) instead of separate ones: fewer GPUs, no overlap of generation and training.",
    )
    add_flag(
        g,
        "--placement-device",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="Device of the training and engine bundles. auto: GPU bundles when the Ray cluster has GPUs (ray.cluster_resources(), whatever the driver's own machine has), else CPU bundles; gpu: require GPUs; cpu: CPU processes even on a GPU cluster (gloo).",
    )
    add_flag(
        g,
        "--ray-num-cpus",
        type=int,
        default=None,
        help="CPUs of the local Ray cluster started when RAY_ADDRESS is unset (default: what the placement needs). Ignored when connecting to an existing cluster.",
    )
    return parser


def validate(args) -> None:
    for flag in (
        "--actor-num-nodes",
        "--actor-num-gpus-per-node",
        "--rollout-num-gpus",
        "--rollout-num-gpus-per-engine",
        "--ray-num-cpus",
    ):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            fail(flag, f"must be >= 1 (got {value})", f"use a positive count, e.g. {flag} 1")
    if args.colocate and args.rollout_num_gpus is not None:
        fail(
            "--colocate with --rollout-num-gpus",
            "a colocated rollout runs on the training GPUs, so a separate rollout GPU count would be ignored",
            "drop --rollout-num-gpus, or drop --colocate",
        )
    per_engine = args.rollout_num_gpus_per_engine
    if args.rollout_num_gpus is not None and per_engine is not None and args.rollout_num_gpus % per_engine != 0:
        fail(
            f"--rollout-num-gpus {args.rollout_num_gpus} with --rollout-num-gpus-per-engine {per_engine}",
            "the rollout GPUs must split into whole engines",
            f"use a multiple of {per_engine} for --rollout-num-gpus",
        )
    if args.rollout_engine == "hf" and per_engine is not None and per_engine > 1:
        fail(
            f"--rollout-engine hf with --rollout-num-gpus-per-engine {per_engine}",
            "Hugging Face generate runs on one device (no tensor parallelism)",
            "use --rollout-engine vllm or sglang for multi-GPU engines, or --rollout-num-gpus-per-engine 1",
        )
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    model_parallel = args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size
    if world % model_parallel != 0:
        fail(
            f"--actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node {args.actor_num_gpus_per_node} = {world} training ranks",
            f"the world must be a multiple of TP x CP x PP = {model_parallel}",
            f"use a world size that is a multiple of {model_parallel}",
        )


def planned_dp_size(args) -> int:
    """The data-parallel size the cluster flags imply: training ranks / (TP x CP x PP). The
    trainer checks the world's actual size again once its actors are up."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    return max(
        1, world // (args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size)
    )
