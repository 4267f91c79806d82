"""Run a function on N real processes joined in a gloo process group (spawned, free port).

    results = run_world(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

``fn`` must be a module-level function (spawn re-imports it). Each rank's return value comes back
serialised with torch.save; a rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, queue, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 600.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [
                i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and i not in results
            ]
            if dead:
                errors.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before reporting")
            elif time.monotonic() > deadline:
                errors.append(
                    f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(results))}"
                )
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed run failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
