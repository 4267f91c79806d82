"""Flags of the weight sync from train rank 0 to the rollout engines (how, not how much: the bucket
size is ``--update-weight-buffer-size`` beside the engine flags)."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail
from rl_plugin.weight_sync.transport import TRANSPORTS  # noqa: F401 - the flag's choices: the transports that exist


def add_arguments(parser):
    g = parser.add_argument_group(
        "weight sync", "How the trainer's weights reach the rollout engines after every rollout."
    )
    add_flag(
        g,
        "--update-weight-transport",
        choices=TRANSPORTS,
        default="auto",
        help=(
            "auto (default): engines on train rank 0's node copy the weights straight from a POSIX shared-memory segment "
            "that rank 0 writes once per sync (created once, reused; no serialisation; two of them, alternating, under "
            "--max-weight-staleness 1, so /dev/shm must hold the weights twice), engines on other nodes read them "
            "from Ray's object store. shared_memory / object_store force one path (shared_memory fails when an engine runs "
            "on another node or /dev/shm cannot hold the weights). distributed (or nccl, its GPU name): train rank 0 broadcasts "
            "each bucket to every engine process over a torch.distributed group made for the purpose (gloo on CPU, NCCL on "
            "GPUs; slime/verl style), every tensor every sync; the engines receive while the trainer publishes. The "
            "shared-memory and object-store paths send only the tensors that changed since the engine's last sync (frozen "
            "ones once). Tied weights travel once."
        ),
    )
    return parser


def validate(args) -> None:
    if args.update_weight_transport in ("distributed", "nccl") and getattr(args, "max_weight_staleness", 0) > 0:
        fail(
            f"--update-weight-transport {args.update_weight_transport} with --max-weight-staleness {args.max_weight_staleness}",
            "the broadcast needs the engines inside their load while the trainer publishes, and under overlapped "
            "training they are generating then: the trainer would wait for every generation",
            "use --update-weight-transport auto (shared memory / object store) with --max-weight-staleness 1",
        )
