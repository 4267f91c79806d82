"""Benchmark: peak host memory per rank of one weight export + publish, before and after streaming.

Each (backend, path) runs in a fresh gloo world of --world processes (Megatron: TP2 x DP2;
FSDP: DP4) on a random Qwen2 checkpoint built here (no download; ~57M parameters by default),
through the train actor's ``export_weight_buckets`` exactly as ``rl-plugin-train`` calls it
(``--update-weight-transport shared_memory`` by default, ``object_store`` with a local Ray):

- ``old``: ``TrainActor.stream_export = False``: every rank materialises ``export_hf_state_dict``
  (Megatron: all-gathers in every TP group, a full CPU copy per rank; FSDP:
  ``get_model_state_dict(full_state_dict=True)``), rank 0 publishes the dict;
- ``new``: the streamed export (``stream_hf_weights``): only DP rank 0's TP group gathers (to
  TP rank 0 alone) / every FSDP rank joins each parameter's all-gather and only rank 0 keeps it,
  and rank 0 writes each tensor into the segment (or the current object-store bucket) as it comes;
- ``dcp`` (FSDP only, for comparison): what torch 2.13 offers off the shelf,
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: each parameter all-gathered on
  every rank, only rank 0 keeps a CPU copy, but of the whole model at once; rank 0 publishes it.

glibc's malloc keeps freed memory resident after large frees (its mmap threshold rises to the
size of the last freed block, up to 32 MiB), which hides what the code holds behind what the
allocator keeps. By default the workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed
threshold: large tensors are mmapped and returned on free), ``--malloc glibc`` keeps glibc's
dynamic default (what a process gets unless it sets the variable).

Per rank: RSS before the first export (``VmRSS``, the model built), the high-water mark of each
sync (``VmHWM``, reset before it by writing 5 to ``/proc/self/clear_refs``), and the shared memory
the transport left mapped (``RssShmem`` + ``RssFile`` growth: the segment, or the object store's
pages, which rank 0 writes and which count in its RSS; the same in both paths: it is the
transport itself).
"extra" = max(peak1, peak2) - before - transport: the private memory the export took. Sync 1
creates the segment; before sync 2 every weight is changed in place, so sync 2 rewrites all of
it. Peaks are taken against the RSS before sync 1, not before each sync: the allocator may keep
the first sync's freed pages resident and reuse them. A third sync with ``--check-weight-sync``'s
fingerprint (not measured) shows both paths publish the same bits. Not a test: RSS depends on the
allocator and the machine.

    python -m benchmarks.export_memory [--backends megatron fsdp] [--hidden 512] [--layers 8]
                                       [--vocab 32000] [--intermediate 1536] [--buffer-mb 16]
                                       [--transport shared_memory|object_store]
                                       [--paths old new dcp] [--malloc fixed|glibc]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch

MIB = 2**20


def proc_status() -> dict:
    """VmRSS / VmHWM / RssAnon / RssFile / RssShmem of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def build_backend(name: str, hf_dir: str, world: int):
    from tests.support.megatron_common import make_args

    if name == "megatron":
        from rl_plugin.backends.megatron.backend import MegatronBackend

        return MegatronBackend.from_args(
            make_args("--hf-checkpoint", hf_dir, "--tensor-model-parallel-size", "2", world_size=world)
        )
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    return FSDPBackend.from_args(make_args("--train-backend", "fsdp", "--hf-checkpoint", hf_dir, world_size=world))


def export_dcp(actor, request):
    """The ``dcp`` path: torch's full state dict with ``cpu_offload`` (rank 0 keeps it), published."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rl_plugin.weight_sync import WeightPublisher

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(actor.backend.model, options=options)
    if actor.rank != 0:
        return None
    if actor.publisher is None:
        actor.publisher = WeightPublisher(request.transport, skip=actor.backend.tied_names)
    return actor.publisher.publish(sd, request)


def worker(rank, world, backend_name, hf_dir, path, buffer_bytes, transport):
    import torch.distributed as dist

    from rl_plugin.ray.train_actor import TrainActor
    from rl_plugin.weight_sync import SyncRequest

    if transport == "object_store" and rank == 0:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, object_store_memory=2 * 1024**3, log_to_driver=False)
    backend = build_backend(backend_name, hf_dir, world)
    actor = TrainActor(rank, world)
    actor.backend, actor.stream_export = backend, path == "new"
    export = (lambda request: export_dcp(actor, request)) if path == "dcp" else actor.export_weight_buckets
    local_bytes = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in backend.model.parameters())
    syncs = []
    gc.collect()
    dist.barrier()
    start = proc_status()
    for sync in (1, 2):
        if sync == 2:  # a stand-in for the optimizer step: every weight changes
            with torch.no_grad():
                for p in backend.model.parameters():
                    p.add_(1e-3)
        gc.collect()
        dist.barrier()
        before = proc_status()
        reset_peak()
        t0 = time.perf_counter()
        handle = export(SyncRequest(buffer_bytes=buffer_bytes, transport=transport))
        seconds = time.perf_counter() - t0
        peak = proc_status()["VmHWM"]
        del handle
        dist.barrier()
        syncs.append(dict(before=before["VmRSS"], peak=peak, seconds=seconds))
    after = proc_status()  # what the transport left mapped: the segment / the object store's pages
    mapped = after["RssShmem"] + after["RssFile"] - start["RssShmem"] - start["RssFile"]
    handle = export(SyncRequest(buffer_bytes=buffer_bytes, transport=transport, fingerprint=True))
    digest = None
    if handle is not None:
        digest = hashlib.sha256(repr(sorted(handle.fingerprint.items())).encode()).hexdigest()[:16]
        actor.close_weight_sync()
    ps = backend.parallel_state
    transport_bytes = mapped
    peak = max(s["peak"] for s in syncs)
    return dict(
        rank=rank,
        dp=ps.dp_rank,
        tp=ps.tp_rank,
        local_bytes=local_bytes,
        start=start["VmRSS"],
        syncs=syncs,
        transport=transport_bytes,
        extra=peak - start["VmRSS"] - transport_bytes,
        digest=digest,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["megatron", "fsdp"], choices=["megatron", "fsdp"])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--buffer-mb", type=float, default=16.0)
    ap.add_argument("--transport", default="shared_memory", choices=["shared_memory", "object_store"])
    ap.add_argument("--paths", nargs="+", default=["old", "new", "dcp"], choices=["old", "new", "dcp"])
    ap.add_argument("--malloc", default="fixed", choices=["fixed", "glibc"])
    args = ap.parse_args()
    if args.malloc == "fixed":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by the spawned workers' glibc at start
    else:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)

    from rl_plugin.models.tiny import make_tiny_hf_checkpoint
    from tests.support.harness import run_world

    tmp = Path(tempfile.mkdtemp(prefix="export_memory_"))
    hf_dir = make_tiny_hf_checkpoint(
        tmp / "qwen2",
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 64,
        num_kv_heads=2,
        intermediate_size=args.intermediate,
    )
    model_bytes = sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors"))
    print(
        f"model: random Qwen2, {model_bytes / MIB:.0f} MiB fp32 (~{model_bytes / 4e6:.0f}M parameters); "
        f"world {args.world}; transport {args.transport}; buffer {args.buffer_mb:g} MiB; malloc {args.malloc}"
    )
    rows = {}
    paths = {b: [p for p in args.paths if p != "dcp" or b == "fsdp"] for b in args.backends}
    for backend in args.backends:
        for path in paths[backend]:
            t0 = time.perf_counter()
            out = run_world(worker, args.world, backend, str(hf_dir), path, int(args.buffer_mb * MIB), args.transport)
            rows[backend, path] = out
            print(f"  {backend} {path}: {time.perf_counter() - t0:.0f} s (world start, build, 3 syncs)", flush=True)

    layout = {"megatron": f"TP2xDP{args.world // 2}", "fsdp": f"DP{args.world}"}
    print()
    head = (
        f"{'backend':9} {'layout':8} {'rank':>4} {'dp,tp':>5} {'path':5} {'holds':>6} {'before':>7} "
        f"{'peak1':>7} {'peak2':>7} {'transp':>7} {'extra':>7} {'old/new':>8} {'sync2 s':>7}"
    )
    print(head + "\n" + "-" * len(head))
    for backend in args.backends:
        for rank in range(args.world):
            for path in paths[backend]:
                r = rows[backend, path][rank]
                s1, s2 = r["syncs"]
                ratio = ""
                if path != "old" and "old" in args.paths:
                    ratio = f"{rows[backend, 'old'][rank]['extra'] / max(r['extra'], MIB):.1f}x"
                print(
                    f"{backend:9} {layout[backend]:8} {rank:>4} {r['dp']:>2},{r['tp']:<2} {path:5} "
                    f"{r['local_bytes'] / MIB:>6.0f} {r['start'] / MIB:>7.0f} {s1['peak'] / MIB:>7.0f} "
                    f"{s2['peak'] / MIB:>7.0f} {r['transport'] / MIB:>7.0f} {r['extra'] / MIB:>7.0f} {ratio:>8} "
                    f"{s2['seconds']:>7.2f}"
                )
        digests = {p: rows[backend, p][0]["digest"] for p in paths[backend]}
        print(f"{backend}: rank 0's --check-weight-sync fingerprint digest per path {digests}")
    print(
        "MiB. holds: this rank's parameters; before: RSS before sync 1; peakN: RSS high-water mark during "
        "sync N; transp: shared memory the transport left mapped in this process (the segment / object store "
        "pages); extra: max(peak1, peak2) - before - transp, the private memory the export took; old/new: "
        "extra old / this path (floored at 1 MiB); sync2 s: seconds of sync 2's export + publish."
    )


if __name__ == "__main__":
    main()
