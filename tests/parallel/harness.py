"""Run a function in N fresh processes joined in one gloo group, and collect what each returns.

`run_ranks(fn, world_size, *args)` starts world_size processes, sets torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_*), calls `fn(rank, world_size, *args)` in each and returns the
results in rank order. A rank that raises fails the test with its traceback and those of the ranks that
failed with it (reported within 10 s); a rank that
hangs is killed after `timeout`. `fn` must be importable (a module-level function).

The processes come from a fork server (one per test process, started at the first call), not from
spawn: the server is a fresh interpreter that has only imported torch and genolong, so each rank
starts with no inherited threads or test state, as a spawned one would, but without its ~2 s of
imports (on the shared 2-core machine a 2-rank launch went from ~3.5 s to ~0.4 s, and
tests/parallel launches dozens). A rank takes the caller's current environment and working
directory, as a spawned one does, rather than the server's from its start.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback

import torch.multiprocessing as mp

# What every rank imports anyway; a module not found here is skipped by the server, not an error.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "genolong.train.loop", "genolong.train.passes",
           "genolong.parallel.sharded_load"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context():
    """The fork server's multiprocessing context (its server shared by every call in this process).
    A process started from it has the server's environment and working directory; run_ranks passes
    the caller's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank, world_size, port, fn, args, queue, environ, cwd):
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001  (the parent reports any failure with its traceback)
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    here = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, *here), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except queue_module.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                errors.append(f"ranks {missing} did not finish within {timeout:.0f} s (a collective waiting for a rank that never came?)")
                break
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
        if errors:
            # The first report may be a peer's symptom (a closed connection, "Broken pipe"): give the
            # other ranks a few seconds to report theirs, so that the failure shows its cause.
            try:
                while len(results) + len(errors) < world_size:
                    rank, status, value = queue.get(timeout=10)
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors.append(f"rank {rank} failed:\n{value}")
            except queue_module.Empty:
                pass
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
