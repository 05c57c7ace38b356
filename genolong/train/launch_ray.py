"""`--launcher ray`: one Ray actor per rank of `--parallel`, in a placement group (docs/parallel.md).

`ray.init()` starts a local Ray unless `--ray-address` names a cluster (several nodes work the
same way). The placement group has one bundle per rank (1 CPU, plus 1 GPU on CUDA), packed onto
as few nodes as possible so that the ranks of a node are neighbours. Every actor reports its
node; the first actor's node address and a free port on it become MASTER_ADDR / MASTER_PORT,
and each actor gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE). On
GPUs, the actors of a node see all of that node's GPUs of the run (CUDA_VISIBLE_DEVICES, as Ray
Train does), LOCAL_RANK picks their own, and the loop joins an NCCL group; with `--device cpu`
a gloo group. Then every actor runs the loop (genolong.train.loop.train) as a torchrun rank would.

The first actor to fail stops the run: the others (waiting in a collective for it) are killed,
and its error comes back as one line naming its rank (a GenolongError's own line, or the last
line of a crash's traceback with the traceback in the log). A single-rank run is one actor
without a process group, exactly the one-process loop.
"""

from __future__ import annotations

import os
import socket
import sys

from genolong.errors import GenolongError
from genolong.train.options import TrainOptions
from genolong.train.worker import run_worker

PLACEMENT_TIMEOUT_S = 300.0


class RankActor:
    """The Ray actor of one rank (a subclass may override `run`, e.g. in tests)."""

    def where(self) -> dict:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "ip": ray.util.get_node_ip_address(),
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "port": port,
        }

    def run(self, options_dict: dict, env: dict[str, str]) -> tuple[str, object]:
        os.environ.update(env)
        return run_worker(options_dict)


def rank_environments(places: list[dict]) -> list[dict[str, str]]:
    """torchrun's variables for each rank from where its actor runs (module docstring)."""
    world = len(places)
    by_node: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        by_node.setdefault(place["node"], []).append(rank)
    envs = []
    for rank, place in enumerate(places):
        peers = by_node[place["node"]]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": places[0]["ip"],
            "MASTER_PORT": str(places[0]["port"]),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "LOCAL_RANK": str(peers.index(rank)),
        }
        if place["gpus"]:
            node_gpus = sorted({g for r in peers for g in places[r]["gpus"]}, key=lambda g: (len(g), g))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env["LOCAL_RANK"] = str(node_gpus.index(place["gpus"][0]))
        envs.append(env)
    return envs


def launch_ray(options: TrainOptions, actor_class: type = RankActor) -> list[dict]:
    """Run `options` on Ray (module docstring); returns rank 0's per-step records."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise GenolongError("--launcher ray needs the ray package: pip install 'ray>=2.40' (or use torchrun)") from None
    from genolong.train.distributed import requested_layout

    world = requested_layout(options).world_size
    started_here = False
    if not ray.is_initialized():
        ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=True)
        started_here = True
    group, actors = None, []
    try:
        wants_gpu = options.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        if options.device and options.device.startswith("cuda") and not wants_gpu:
            raise GenolongError(f"--device {options.device} but the Ray cluster has no GPU; use --device cpu or another --ray-address")
        bundle = {"CPU": 1, "GPU": 1} if wants_gpu else {"CPU": 1}
        group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise GenolongError(
                f"the Ray cluster could not place {world} rank(s) of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(it has {ray.cluster_resources()}); add nodes or lower --parallel"
            ) from None
        remote = ray.remote(actor_class)
        actors = [
            remote.options(
                num_cpus=1,
                num_gpus=1 if wants_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(world)
        ]
        places = ray.get([a.where.remote() for a in actors])
        envs = rank_environments(places) if world > 1 else [{}]
        options_dict = options.to_dict()
        running = {actor.run.remote(options_dict, env): rank for rank, (actor, env) in enumerate(zip(actors, envs, strict=True))}
        return _first_failure_stops_all(ray, running)[0]
    finally:
        for actor in actors:
            ray.kill(actor)
        if group is not None:
            remove_placement_group(group)
        if started_here:
            ray.shutdown()


def _first_failure_stops_all(ray, running: dict) -> dict[int, list[dict]]:
    """Each rank's records; at the first rank that fails, GenolongError with its error (the caller kills the rest)."""
    results: dict[int, list[dict]] = {}
    pending = list(running)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank = running[done[0]]
        try:
            kind, payload = ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            raise GenolongError(
                f"rank {rank}: its Ray actor died before reporting ({err.__class__.__name__}; killed for memory? "
                "check the Ray logs); the other ranks were stopped"
            ) from None
        if kind == "ok":
            results[rank] = payload
            continue
        if kind == "error":
            raise GenolongError(f"rank {rank}: {payload}")
        if kind == "interrupted":
            raise GenolongError(f"rank {rank} was stopped (SIGTERM / Ctrl-C in its actor); the other ranks were stopped")
        print(f"genolong: rank {rank} failed:\n{payload}", file=sys.stderr, flush=True)
        last = str(payload).strip().splitlines()[-1] if str(payload).strip() else "no message"
        raise GenolongError(f"rank {rank} failed ({last}); its traceback is above; the other ranks were stopped")
    return results

