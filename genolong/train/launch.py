"""Start the training loop in one worker: a spawned local process (default) or a Ray actor.

The worker runs `genolong.train.loop.train` unchanged and sends back its per-step records. A
separate process keeps the CLI's interpreter free of CUDA state and lets a crash of the worker
(out of host memory, a CUDA fault) end in a one-line report instead of a dead shell; Ray runs
the same worker where a cluster scheduler places it. Later multi-GPU launchers start several
such workers; the loop itself never creates a process group.

A `GenolongError` raised in the worker (bad input, a run stopped for non-finite losses) comes
back as a `GenolongError` with the same one-line message; anything else comes back with the
worker's traceback.

Lifetimes (genolong.train.lifeline): the local worker dies with this process however it dies,
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
import traceback

from genolong.errors import GenolongError
from genolong.train import lifeline
from genolong.train.options import TrainOptions

# After forwarding a stop request, how long to wait for the worker to finish a checkpoint it is
# writing before killing it (a glm-5.3-flash-sized save takes minutes; Ctrl-C again kills now).
STOP_GRACE_S = 600.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C / SIGTERM ended the run; the message says where it stopped and what to type next."""


def launch(options: TrainOptions) -> list[dict]:
    """Run `options` in a worker chosen by `options.launcher`; returns the per-step records."""
    from genolong.train.loop import check_inputs

    check_inputs(options)
    if options.launcher == "ray":
        return _launch_ray(options)
    return _launch_local(options)


def _run(options_dict: dict) -> tuple[str, object]:
    """("ok", records) | ("error", one-line message) | ("crash", traceback) | ("interrupted", None):
    picklable whatever happens."""
    from genolong.train.loop import train

    try:
        return "ok", train(TrainOptions.from_dict(options_dict))
    except GenolongError as err:
        return "error", str(err)
    except KeyboardInterrupt:
        return "interrupted", None
    except Exception:  # noqa: BLE001  (any failure must reach the parent, with its traceback)
        return "crash", traceback.format_exc()


def _process_main(options_dict: dict, conn, parent_pid: int) -> None:
    lifeline.stop_on_sigterm()
    lifeline.follow_parent(parent_pid)
    result = _run(options_dict)
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


class _RayWorker:
    """The Ray actor: one training run per call."""

    def run(self, options_dict: dict) -> tuple[str, object]:
        return _run(options_dict)


def _launch_ray(options: TrainOptions) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise GenolongError("--launcher ray needs the ray package: pip install 'ray>=2.40' (or use --launcher local)") from None
    started_here = False
    if not ray.is_initialized():
        # Local instance unless an address is given; the dashboard is not needed to run one actor.
        ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=True)
        started_here = True
    try:
        wants_gpu = options.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        if options.device and options.device.startswith("cuda") and not wants_gpu:
            raise GenolongError(f"--device {options.device} but the Ray cluster has no GPU; use --device cpu or another --ray-address")
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if wants_gpu else 0)(_RayWorker)
        actor = actor_cls.remote()
        try:
            result = ray.get(actor.run.remote(options.to_dict()))
        except ray.exceptions.RayActorError as err:
            raise GenolongError(f"the Ray training actor died before reporting ({err.__class__.__name__}); check the Ray logs") from None
        finally:
            ray.kill(actor)
        return _unwrap(result, "Ray actor")
    finally:
        if started_here:
            ray.shutdown()
