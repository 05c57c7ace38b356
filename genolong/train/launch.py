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

Lifetimes (genolong.lifeline): the local worker dies with this process however it dies,
and this process reports the worker's death (exit code or signal, with the out-of-memory hint)
and what to type next. Ctrl-C (or SIGTERM) here is forwarded to the worker once; the worker
stops at a safe point (a checkpoint being written is finished first; a second Ctrl-C abandons
it, and then this process kills the worker), and both exit with code 130 and one line.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading

from genolong.errors import GenolongError
from genolong import lifeline
from genolong.train.options import TrainOptions
from genolong.train.worker import run_worker

# After forwarding a stop request, how long to wait for the worker to finish a checkpoint it is
# writing before killing it (a glm-5.3-flash-sized save takes minutes; Ctrl-C again kills now).
STOP_GRACE_S = 600.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM ended the run; the message says where it stopped and what to type next."""


def launch(options: TrainOptions) -> list[dict]:
    """Run `options` in a worker chosen by `options.launcher`; returns the per-step records."""
    from genolong.parallel.mesh import launched_world
    from genolong.train.loop import check_inputs

    spec = check_inputs(options)
    if launched_world() is not None:
        return _run_here(options, spec)
    if options.launcher == "ray":
        from genolong.train.launch_ray import launch_ray

        return launch_ray(options)
    return _launch_local(options)


def _run_here(options: TrainOptions, spec) -> list[dict]:
    """One rank of a torchrun world: the loop in this process (with the run as `launch` resolved it);
    a rank other than 0 names itself in its error."""
    from genolong.parallel.mesh import launched_world
    from genolong.train.loop import train

    rank = launched_world()[0]
    # A rank ends with its torchrun agent, as the local launcher's workers end with theirs: killed
    # with SIGKILL, the agent cannot stop them, and they would train on holding the run's lock.
    lifeline.follow_parent(os.getppid())
    try:
        return train(options, spec)
    except GenolongError as err:
        if rank == 0:
            raise
        raise GenolongError(f"rank {rank}: {err}") from None


def _process_main(options_dict: dict, conn, parent_pid: int) -> None:
    lifeline.stop_on_sigterm()
    lifeline.follow_parent(parent_pid)
    result = run_worker(options_dict)
    try:
        conn.send(result)
    except (BrokenPipeError, EOFError, OSError):
        pass  # the parent is gone; the lifeline already said so
    finally:
        conn.close()
    if result[0] == "interrupted":
        sys.exit(lifeline.EXIT_INTERRUPTED)


def _unwrap(result: tuple[str, object], where: str, run_dir: str | None = None) -> list[dict]:
    kind, payload = result
    if kind == "ok":
        return payload
    if kind == "error":
        raise GenolongError(payload)
    if kind == "interrupted":
        raise Interrupted(_next_step(run_dir))
    raise RuntimeError(f"the training worker ({where}) failed:\n{payload}")


def _next_step(run_dir: str | None) -> str:
    from genolong.train.checkpoint import recovery_hint

    return recovery_hint(run_dir) if run_dir else "the run stopped"


def _death(exitcode: int | None) -> str:
    """How the worker ended, in words, with the likely cause of a SIGKILL."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        if -exitcode == signal.SIGKILL:
            return (
                f"was killed by {name} (the kernel's out-of-memory killer sends SIGKILL: check `dmesg | grep -i oom`; "
                "`genolong plan` estimates the run's memory; lower --seq, or on a GPU keep --offload on)"
            )
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _launch_local(options: TrainOptions) -> list[dict]:
    # spawn, not fork: a forked child would inherit the parent's threads and any CUDA context.
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_process_main, args=(options.to_dict(), sender, os.getpid()), name="genolong-train")
    # A batch scheduler's SIGTERM to this process takes the Ctrl-C path below.
    main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, _terminate_as_interrupt) if main_thread else None
    try:
        worker.start()
        sender.close()
        try:
            result = receiver.recv()
        except EOFError:
            worker.join()
            raise GenolongError(f"the training worker {_death(worker.exitcode)} before reporting; {_next_step(options.out)}") from None
        except KeyboardInterrupt:
            _stop(worker)
            raise Interrupted(_next_step(options.out)) from None
        worker.join()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_term)
        if worker.is_alive():
            worker.kill()
            worker.join()
    return _unwrap(result, "local process", options.out)


def _terminate_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop(worker) -> None:
    """Forward one stop request; wait for a safe point; a second Ctrl-C (or the grace) kills the worker."""
    if worker.is_alive():
        os.kill(worker.pid, signal.SIGTERM)
        print("genolong: stopping the training worker (Ctrl-C again to kill it now)", file=sys.stderr, flush=True)
    try:
        worker.join(STOP_GRACE_S)
    except KeyboardInterrupt:
        pass
    if worker.is_alive():
        worker.kill()
        worker.join()
