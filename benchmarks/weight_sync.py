"""Benchmark: one weight sync, object store vs shared memory, trainer and engine in separate Ray actors.

A "trainer" actor holds an export (a Hugging Face state dict) and publishes it with
``WeightPublisher`` (``rl_plugin.weight_sync``); an "engine" actor loads it in place with
``WeightReceiver`` + ``engine.update_weights``, as ``rl-plugin-train`` does (the handle passed
as an ObjectRef, one driver wait per sync). Before every sync the trainer changes its weights
(untimed: a stand-in for the optimizer step), so each sync moves real new values. Timed: publish
+ load, from the driver's call to the engine's return. MB/s = the model's bytes / seconds.

Transports, in the same session:
- ``object_store``: every bucket ``ray.put`` by the trainer and ``ray.get`` by the engine (the
  path before shared memory; every sync moves the whole model).
- ``shared_memory``: the trainer writes into its segment, the engine copies from the views.
- ``shared_memory, 1/2 frozen``: half of the tensors never change (frozen layers), so after the
  first sync only the other half moves.
- ``shm, 2 slots``: the double buffer of overlapped training (``--max-weight-staleness 1``), sync
  v written into slot v % 2 with everything changed since the sync that slot held.

Models: the embedded tiny Qwen2 into an HF engine, and a synthetic set of fp32 tensors (default
256 MiB in 4 MiB tensors) into a plain parameter dict. Each timing is the median of --syncs
syncs after one warm-up sync (which creates the segment and maps it). Not a test: numbers depend
on the machine and its load.

    python -m benchmarks.weight_sync [--synthetic-mb 256] [--tensor-mb 4] [--syncs 5] [--buffer-mb 512]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict

import torch


class TensorEngine:
    """A rollout engine reduced to its parameters: ``update_weights`` copies in place."""

    def __init__(self, shapes: Dict[str, tuple]):
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}

    def update_weights(self, bucket):
        for name, value in bucket.items():
            self.params[name].copy_(value)

    def weights(self):
        return self.params


class Trainer:
    def __init__(self, state_dict, transport: str, frozen_fraction: float, slots: int = 1):
        torch.set_num_threads(1)
        from rl_plugin.weight_sync import WeightPublisher

        self.sd = state_dict
        names = list(state_dict)
        self.trained = names[int(len(names) * frozen_fraction) :]
        self.publisher = WeightPublisher(transport)
        self.transport, self.slots = transport, slots

    def step(self, k: int) -> None:
        for n in self.trained:
            self.sd[n].add_(1e-3 * (k + 1))

    def publish(self, buffer_bytes: int, check: bool):
        from rl_plugin.weight_sync import SyncRequest

        return self.publisher.publish(
            self.sd,
            SyncRequest(buffer_bytes=buffer_bytes, transport=self.transport, fingerprint=check, slots=self.slots),
        )

    def close(self):
        self.publisher.close()


class Engine:
    def __init__(self, kind: str, arg):
        torch.set_num_threads(1)
        from rl_plugin.weight_sync import WeightReceiver

        if kind == "hf":
            from rl_plugin.rollout.engines.hf_engine import HFEngine

            self.engine = HFEngine(arg)
        else:
            self.engine = TensorEngine(arg)
        self.receiver = WeightReceiver()

    def load(self, handle):
        from rl_plugin.weight_sync import load_sync

        return load_sync(self.engine, self.receiver, handle)


def run_case(
    state_dict, engine_kind, engine_arg, transport: str, frozen: float, syncs: int, buffer_bytes: int, slots: int = 1
) -> dict:
    import ray

    trainer = ray.remote(Trainer).remote({k: v.clone() for k, v in state_dict.items()}, transport, frozen, slots)
    engine = ray.remote(Engine).remote(engine_kind, engine_arg)
    times, loaded = [], []
    for k in range(syncs + 1):
        ray.get(trainer.step.remote(k))
        t0 = time.perf_counter()
        stats = ray.get(engine.load.remote(trainer.publish.remote(buffer_bytes, k == 0)))
        dt = time.perf_counter() - t0
        if k == 0:  # warm-up; and the engine must hold the trainer's weights bitwise
            ref = ray.get(trainer.publish.remote(buffer_bytes, True)).fingerprint
            got = ray.get(engine.load.remote(trainer.publish.remote(buffer_bytes, True)))["fingerprint"]
            if got != ref:
                raise RuntimeError(f"{transport}: the engine's weights differ from the trainer's after a sync")
            continue
        times.append(dt)
        loaded.append(stats["bytes"])
    ray.get(trainer.close.remote())
    for a in (trainer, engine):
        ray.kill(a)
    return {"seconds": statistics.median(times), "loaded_mb": statistics.median(loaded) / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic-mb", type=int, default=256)
    p.add_argument("--tensor-mb", type=int, default=4)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--buffer-mb", type=int, default=512, help="--update-weight-buffer-size in MiB")
    a = p.parse_args()
    import os

    import ray
    from safetensors.torch import load_file

    from rl_plugin.loop.embedded_setup import ensure_tiny_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=max(512, 3 * a.synthetic_mb) * 2**20)
    tiny = ensure_tiny_model(Path(tempfile.mkdtemp(prefix="weight_sync_")))
    tiny_sd = load_file(str(Path(tiny) / "model.safetensors"))
    n = max(1, a.synthetic_mb // a.tensor_mb)
    numel = a.tensor_mb * 2**20 // 4
    synth = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(numel // 1024, 1024) for i in range(n)}
    models = {
        "tiny qwen2 (hf engine)": (tiny_sd, "hf", str(tiny), max(20, a.syncs)),
        f"synthetic {n}x{a.tensor_mb} MiB": (synth, "tensors", {k: tuple(v.shape) for k, v in synth.items()}, a.syncs),
    }
    cases = [
        ("object_store", "object_store", 0.0, 1),
        ("shared_memory", "shared_memory", 0.0, 1),
        ("shm, 1/2 frozen", "shared_memory", 0.5, 1),
        ("shm, 2 slots", "shared_memory", 0.0, 2),
    ]
    buffer_bytes = a.buffer_mb * 2**20
    print(f"{'model':28} {'MB':>8} {'transport':16} {'moved MB':>9} {'s/sync':>9} {'MB/s':>9} {'vs object store':>15}")
    for label, (sd, kind, arg, syncs) in models.items():
        mb = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
        base = None
        for name, transport, frozen, slots in cases:
            r = run_case(sd, kind, arg, transport, frozen, syncs, buffer_bytes, slots)
            base = base or r["seconds"]
            print(
                f"{label:28} {mb:8.2f} {name:16} {r['loaded_mb']:9.2f} {r['seconds']:9.4f} {mb / r['seconds']:9.1f} "
                f"{base / r['seconds']:14.2f}x",
                flush=True,
            )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
