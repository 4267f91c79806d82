"""Transport of a rollout's tensors: torch's pickling, numpy arrays (pickle-5 out-of-band
buffers) and ``rl_plugin.tensor_pickle`` (one in-band buffer), through ``pickle`` in this
process and as the argument of a Ray actor call (the way a RolloutData, StepBatch or RankPlan
travels), with a no-op call as the floor. The payload: the six tensors of an embedded-size
rollout (128 samples of ~9 tokens, ~16 KB).

    python -m benchmarks.transport_pickle [--repeats 300] [--rounds 3]

Prints the median per round (the machine's speed drifts: compare within a round) and the ratio
to torch's. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from statistics import median

import ray
import torch

from rl_plugin.tensor_pickle import pack_tensors, unpack_tensors


class AsNumpy:
    """The previous StepBatch format: numpy arrays, copied when read-only."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __reduce__(self):
        return _from_numpy, ([t.numpy() for t in self.tensors],)


def _from_numpy(arrays):
    return [torch.from_numpy(a if a.flags.writeable else a.copy()) for a in arrays]


class Packed:
    def __init__(self, tensors):
        self.tensors = tensors

    def __reduce__(self):
        return unpack_tensors, (pack_tensors(self.tensors),)


def payload():
    g = torch.Generator().manual_seed(0)
    rl = torch.randint(1, 5, (128,), generator=g)
    tl = rl + 6
    return [
        torch.randint(0, 16, (int(tl.sum()),), generator=g),
        tl,
        rl,
        -torch.rand(int(rl.sum()), generator=g),
        torch.rand(128, generator=g),
        torch.arange(16).repeat_interleave(8),
    ]


def timed(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * median(ts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    # the formats' classes by reference from this file as a module (the Ray worker imports it from
    # the repository root, which its PYTHONPATH names), not pickled by value from __main__ on every call
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    from benchmarks import transport_pickle as formats

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Sink:
        def take(self, x=None):
            return None

    sink = Sink.remote()
    ray.get(sink.take.remote())
    tensors = payload()
    ways = {"torch": tensors, "numpy": formats.AsNumpy(tensors), "tensor_pickle": formats.Packed(tensors)}
    rows = {}
    for _ in range(a.rounds):
        rows.setdefault(("ray call", "no-op"), []).append(timed(lambda: ray.get(sink.take.remote()), a.repeats))
        for name, obj in ways.items():
            local = timed(lambda obj=obj: pickle.loads(pickle.dumps(obj, protocol=5)), a.repeats)
            rows.setdefault(("pickle dumps+loads", name), []).append(local)
            call = timed(lambda obj=obj: ray.get(sink.take.remote(obj)), a.repeats)
            rows.setdefault(("ray call with it", name), []).append(call)
    ray.shutdown()
    print(f"\nmedian ms per round, {a.repeats} repeats; ratio = median / torch's")
    print(f"{'what':20} {'format':14} {'median':>8} {'ratio':>6}   per round")
    for (what, name), per in rows.items():
        base = rows.get((what, "torch"), per)
        print(
            f"{what:20} {name:14} {median(per):8.3f} {median(per) / median(base):6.2f}   "
            + " ".join(f"{x:.3f}" for x in per)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
