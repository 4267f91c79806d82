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
            "on another node or /dev/shm cannot hold the weights). nccl: a GPU broadcast group from rank 0 to the engines "
            "(slime/verl style), not implemented in this build. Every path sends only the tensors that changed since the "
            "engine's last sync (frozen ones once) and tied weights once."
        ),
    )
    return parser


def validate(args) -> None:
    if args.update_weight_transport == "nccl":
        fail(
            "--update-weight-transport nccl",
            "the NCCL weight broadcast (GPU only) is not implemented in this build",
            "use --update-weight-transport auto (shared memory on the trainer's node, the object store elsewhere)",
        )
