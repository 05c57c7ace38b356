"""Start the training loop: in this process under torchrun, in a spawned local process, or in Ray actors.

- torchrun (RANK, WORLD_SIZE, ... in the environment): this process *is* one rank; the loop runs
  here, on every rank (no extra worker), and joins the process group itself
  (genolong.train.distributed). Rank 0 prints the progress; torchrun's agent ends every rank when
  one dies.
- local (default): one spawned worker process runs `genolong.train.loop.train` unchanged and
  sends back its per-step records. A separate process keeps the CLI's interpreter free of CUDA
  state and lets a crash of the worker (out of host memory, a CUDA fault) end in a one-line
  report instead of a dead shell.
- ray: one actor per rank of `--parallel` (genolong.train.launch_ray), placed in a placement
  group; a single-rank run is one actor.

A `GenolongError` raised in the worker (bad input, a run stopped for non-finite losses) comes
back as a `GenolongError` with the same one-line message; anything else comes back with the
worker's traceback.
"""

from __future__ import annotations

import multiprocessing
import traceback

from genolong.errors import GenolongError
from genolong.train.options import TrainOptions


def launch(options: TrainOptions) -> list[dict]:
    """Run `options` in a worker chosen by `options.launcher`; returns the per-step records."""
    from genolong.train.loop import check_inputs

    from genolong.parallel.mesh import launched_world

    check_inputs(options)
    if launched_world() is not None:
        return _run_here(options)
    if options.launcher == "ray":
        from genolong.train.launch_ray import launch_ray

        return launch_ray(options)
    return _launch_local(options)


def _run_here(options: TrainOptions) -> list[dict]:
    """One rank of a torchrun world: the loop in this process; a rank other than 0 names itself in its error."""
    from genolong.parallel.mesh import launched_world
    from genolong.train.loop import train

    rank = launched_world()[0]
    try:
        return train(options)
    except GenolongError as err:
        if rank == 0:
            raise
        raise GenolongError(f"rank {rank}: {err}") from None


def _run(options_dict: dict) -> tuple[str, object]:
    """("ok", records) | ("error", one-line message) | ("crash", traceback): picklable whatever happens."""
    from genolong.train.loop import train

    try:
        return "ok", train(TrainOptions.from_dict(options_dict))
    except GenolongError as err:
        return "error", str(err)
    except Exception:  # noqa: BLE001  (any failure must reach the parent, with its traceback)
        return "crash", traceback.format_exc()


def _process_main(options_dict: dict, conn) -> None:
    try:
        conn.send(_run(options_dict))
    finally:
        conn.close()


def _unwrap(result: tuple[str, object], where: str) -> list[dict]:
    kind, payload = result
    if kind == "ok":
        return payload
    if kind == "error":
        raise GenolongError(payload)
    raise RuntimeError(f"the training worker ({where}) failed:\n{payload}")


def _launch_local(options: TrainOptions) -> list[dict]:
    # spawn, not fork: a forked child would inherit the parent's threads and any CUDA context.
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_process_main, args=(options.to_dict(), sender), name="genolong-train")
    worker.start()
    sender.close()
    try:
        try:
            result = receiver.recv()
        except EOFError:
            worker.join()
            raise GenolongError(
                f"the training worker exited with code {worker.exitcode} before reporting (killed for memory? "
                "check `dmesg`, lower --seq or enable --offload); the last complete checkpoint can be resumed"
            ) from None
        worker.join()
    except KeyboardInterrupt:
        worker.terminate()
        worker.join()
        raise
    return _unwrap(result, "local process")
