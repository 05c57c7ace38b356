"""Process groups for a layout: started from torchrun's environment, named by what they reduce.

Mesh dimensions, outermost first: ("dp", "ep", "fsdp", "cp", "tp"). tp is innermost so that its
ranks, which talk in every layer, are neighbours (the same node, NVLink); fsdp and cp are
adjacent, since FSDP shards over both (genolong.parallel.fsdp). Flattened groups:

- "batch" = dp x fsdp x ep: ranks that read different sequences (the sampler is sharded over it).
- "loss"  = dp x fsdp x ep x cp: every rank whose tokens enter the step's loss; the valid-token
  count is summed over it, so each token counts once however the sequence is split.
- "grad"  = dp x fsdp x ep x cp: gradients of parameters replicated across it are *summed* there
  (each rank's loss is already divided by the global count, so the sum is the mean).

On CUDA the backend is NCCL, elsewhere gloo (the CPU tests run the same code on gloo).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from genolong.errors import GenolongError
from genolong.parallel.layout import ParallelLayout

MESH_DIMS = ("dp", "ep", "fsdp", "cp", "tp")


@dataclass
class ParallelMesh:
    layout: ParallelLayout
    mesh: DeviceMesh

    def group(self, name: str) -> dist.ProcessGroup:
        """The process group of one dimension ("dp", "fsdp", "ep", "cp", "tp") or flattened name ("batch", "loss", "grad")."""
        return self.mesh[name].get_group()

    def rank(self, name: str) -> int:
        return self.mesh[name].get_local_rank()

    def size(self, name: str) -> int:
        return self.mesh[name].size()


def launched_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when started by torchrun (or a compatible launcher), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def init_distributed(device_type: str, timeout_s: float | None = None) -> tuple[int, int]:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU); returns (rank, world_size).

    On CUDA each process takes the GPU of its LOCAL_RANK, so `--device cuda` means "this rank's GPU".
    timeout_s: how long a collective waits for a missing rank before failing (None: torch's default)."""
    world = launched_world()
    if world is None:
        raise GenolongError(
            "--parallel with more than one process needs a launcher: start it with "
            "`torchrun --standalone --nproc_per_node=N -m genolong finetune ...` or use --launcher ray"
        )
    rank, world_size, local_rank = world
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise GenolongError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; start at most that many processes per node"
            )
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        if device_type == "cuda":
            # Binding the group to this rank's GPU up front: NCCL otherwise guesses the device per
            # collective and warns that a wrong guess can hang ("No device id is provided ...").
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", **kwargs)
    return rank, world_size


def build_mesh(layout: ParallelLayout, device_type: str) -> ParallelMesh:
    """The DeviceMesh for `layout` over the already initialised world (see the module docstring)."""
    sizes = tuple(getattr(layout, name) for name in MESH_DIMS)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    mesh["dp", "ep", "fsdp"]._flatten("batch")
    mesh["dp", "ep", "fsdp", "cp"]._flatten("loss")
    mesh["dp", "ep", "fsdp", "cp"]._flatten("grad")
    return ParallelMesh(layout, mesh)



def leave_together() -> None:
    """End this process's part of a run that finished without error: wait until every rank is
    here, destroy the process groups, and free them now. The caller drops its own references to
    the mesh and its groups first (its ParallelMesh, a RankShare's group, closures over them).

    Why each step. destroy_process_group() shuts the groups down but does not free them: a
    DeviceMesh keeps its groups in a registry, and a flattened mesh and its root point at each
    other, so the objects live on in a reference cycle until the garbage collector runs, which may
    be at interpreter exit; a gloo group freed there has aborted its process ("terminate called
    without an active exception", SIGABRT), failing the whole torchrun after its outputs were
    written (the CI failure of 2026-12-02: eval-positional dp=2). gc.collect() frees them while
    the interpreter is whole. The barrier first: a rank done early (its last window scored while
    rank 0 still aggregates and plots) does not tear down while rank 0 is busy. Not for a run
    ending in an error: the other ranks may never reach the barrier."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
