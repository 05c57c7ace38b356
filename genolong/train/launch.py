"""Start the training loop in one worker: a spawned local process (default) or a Ray actor.

The worker runs `genolong.train.loop.train` unchanged and sends back its per-step records. A
separate process keeps the CLI's interpreter free of CUDA state and lets a crash of the worker
(out of host memory, a CUDA fault) end in a one-line report instead of a dead shell; Ray runs
the same worker where a cluster scheduler places it. Later multi-GPU launchers start several
such workers; the loop itself never creates a process group.

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

    check_inputs(options)
    if options.launcher == "ray":
        return _launch_ray(options)
    return _launch_local(options)


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
