"""Run a function on N real processes joined in a gloo process group (fresh processes, free port).

    results = run_world(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable

``fn`` must be a module-level function (spawn re-imports it). Each rank's return value comes back
serialised with torch.save; a rank that raises fails the call with its traceback.

``use_forkserver(preload)`` (the test suite's conftest calls it; benchmarks keep ``spawn``): the
ranks are forked from one server process that imported ``preload`` (torch, transformers,
megatron-core, ...) once, instead of each spawned rank importing them again (~4.5 s a call with
Megatron on 2 cores, ~0.1 s forked). Each rank still starts as a fresh process would: the caller's
current environment, working directory and ``sys.path``, torch's default seed, a fresh NumPy seed;
nothing of an earlier call's ranks (the server itself never runs a rank). Only what the preloaded
modules read from the environment at import time is the server's (the suite sets none of it).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONTEXT = "spawn"


def use_forkserver(preload) -> None:
    """Start every later ``run_world``'s ranks from a forkserver that imported ``preload`` (module
    names; one that fails to import is skipped by multiprocessing). Process-wide, call it once."""
    global _CONTEXT
    mp.set_forkserver_preload(list(preload))
    _CONTEXT = "forkserver"


def _fresh_process_state(env) -> None:
    """What a spawned rank has and a forked one inherits from the server: the caller's environment
    (the server's is the one it started with), torch's default seed, a fresh NumPy seed."""
    os.environ.clear()
    os.environ.update(env)
    torch.manual_seed(torch.initial_seed())
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _entry(fn, rank, world_size, port, queue, args, env):
    _fresh_process_state(env)
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
    ctx = mp.get_context(_CONTEXT)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args, env), daemon=True)
        for r in range(world_size)
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
