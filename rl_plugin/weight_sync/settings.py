"""SyncSettings: the weight sync's flags (transport, bucket size, the bitwise check), declared here
and read once by the loop (``LoopConfig.sync``)."""

from __future__ import annotations

from dataclasses import dataclass

from rl_plugin.errors import fail
from rl_plugin.flags import Declared, derived, flag, runtime
from rl_plugin.registries import WEIGHT_TRANSPORTS  # the flag's choices (no torch import)

GROUP = "weight sync"


@dataclass(frozen=True)
class SyncSettings(Declared):
    """How the trainer's weights reach the engines, read once."""

    buffer_bytes: int = flag(
        "--update-weight-buffer-size",
        type=int,
        default=512 * 1024**2,
        group=GROUP,
        unit="bytes",
        help="Bytes per bucket of the weight sync from train rank 0 to the rollout engines (slime's flag, default 512 MiB): the export is sent bucket after bucket and loaded in place, a fused q/k/v or gate/up group always whole. Lower it when the object store or GPU memory is tight; raise it to cut per-bucket overhead.",
    )
    transport: str = flag(
        "--update-weight-transport",
        choices=WEIGHT_TRANSPORTS,
        default="auto",
        group=GROUP,
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
    check_weights: bool = flag(
        "--check-weight-sync",
        "--check-weight-update-equal",
        action="store_true",
        group=GROUP,
        help="After every weight sync, verify that every rollout engine's weights are bitwise equal to the trainer's export (sha256 per tensor, read back from the engine: vLLM's repacked CPU linears through their own kernel); raises on a mismatch. For debugging a new backend or engine. slime spells it --check-weight-update-equal; both are accepted.",
    )
    # fingerprint both sides of every sync: --check-weight-sync, --ci-test (slime's in-loop checks,
    # rl_plugin.configs.ci_checks), or --check-lora-weight-equal (declared with LoRA's flags): with LoRA
    # what travels, and so what is compared, is the adapters
    fingerprint: bool = derived(
        lambda args: bool(args.check_weight_sync or args.ci_test or args.check_lora_weight_equal), False
    )
    # 2 when the run's mode generates ahead of training (a load of v - 1 may run while v is published);
    # given by the run config from its mode (rl_plugin.configs.run)
    slots: int = runtime(1)

    def check(self, run) -> None:
        size = self.buffer_bytes
        if size is not None and size < 1:
            fail(
                "--update-weight-buffer-size",
                f"must be >= 1 byte (got {size})",
                "use e.g. 536870912 (512 MiB, slime's default)",
            )
        if self.transport in ("distributed", "nccl") and run.async_training.generates_ahead:
            fail(
                f"--update-weight-transport {self.transport} with --max-weight-staleness {run.async_training.max_weight_staleness}",
                "the broadcast needs the engines inside their load while the trainer publishes, and under overlapped "
                "training they are generating then: the trainer would wait for every generation",
                "use --update-weight-transport auto (shared memory / object store) with --max-weight-staleness 1",
            )
