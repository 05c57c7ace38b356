"""The processes of a training run: one (no process group: today's loop), or one rank of a torchrun /
Ray world with its ParallelMesh (docs/parallel.md).

`start(options, device)` is called by every process of a run after `check_processes` (part of
resolving the run, genolong.train.resolve): under torchrun's environment (RANK, WORLD_SIZE, ...)
it joins the process group (NCCL on CUDA, gloo on the CPU) with the run's collective timeout and
builds the mesh of the layout that check_processes accepted for the number of processes started.
`--parallel` unset under torchrun means dp = the number of processes. What the loop needs from the
mesh is here too: which sequences and which part of them this rank reads, the sums that make the
loss and the metrics global, and which rank writes logs (rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from genolong.errors import GenolongError
from genolong.parallel.layout import ParallelLayout, check_layout, parse_layout
from genolong.parallel.mesh import launched_world, leave_together


@dataclass
class Processes:
    device: str
    pmesh: object | None = None  # genolong.parallel.mesh.ParallelMesh; None: one process, no group
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # this run created the process group (and destroys it at the end)

    @property
    def main(self) -> bool:
        """Rank 0 writes the logs, the run directory's files and the manifest of every checkpoint."""
        return self.rank == 0

    @property
    def layout(self) -> ParallelLayout:
        return self.pmesh.layout if self.pmesh is not None else ParallelLayout()

    def coords(self, name: str) -> tuple[int, int]:
        """(this rank's index, size) in mesh group `name` ("batch", "cp", "loss", ...); (0, 1) for one process."""
        if self.pmesh is None:
            return 0, 1
        return self.pmesh.rank(name), self.pmesh.size(name)

    def sum(self, value: torch.Tensor, group: str = "loss") -> torch.Tensor:
        """`value` summed over mesh group `group` (in place; unchanged for one process)."""
        if self.pmesh is not None:
            dist.all_reduce(value, group=self.pmesh.group(group))
        return value

    def max_over_ranks(self, values: list[float | None]) -> list[float | None]:
        """Each value's maximum over every rank (None stays None: the same on every rank)."""
        if self.pmesh is None or not values:
            return values
        t = torch.tensor([v if v is not None else float("-inf") for v in values], dtype=torch.float64, device=self._reduce_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(x) if v is not None else None for x, v in zip(t.tolist(), values, strict=True)]

    def expert_count_reducer(self):
        """`reduce=` for the expert balancer: the step's expert loads summed over every rank routing other tokens."""
        from genolong.parallel.expert import expert_count_reducer

        return expert_count_reducer(self.pmesh)

    def barrier(self) -> None:
        if self.pmesh is not None:
            dist.barrier()

    def close(self, finished: bool) -> None:
        """Destroy the group this run created; after a run that `finished`, once every rank is done
        (genolong.parallel.mesh.leave_together); after an error at once (the others may never come)."""
        if self.owns_group and dist.is_initialized():
            self.pmesh = None  # this object's reference to the groups, so that leave_together can free them
            if finished:
                leave_together()
            else:
                dist.destroy_process_group()

    def _reduce_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"


def launched_rank() -> int:
    """This process's rank under torchrun / the Ray launcher, 0 for a process started alone."""
    world = launched_world()
    return world[0] if world is not None else 0


def requested_layout(options) -> ParallelLayout:
    """`--parallel`, or dp = the launched world size when it is unset."""
    world = launched_world()
    if not options.parallel and world is not None:
        return ParallelLayout(dp=world[1])
    return parse_layout(options.parallel)


def check_processes(options, config) -> None:
    """Every check of `--parallel` that needs no process group (the launcher and each rank run it)."""
    layout = requested_layout(options)
    world = launched_world()
    if world is None and not layout.is_single and options.launcher != "ray":
        raise GenolongError(
            f"--parallel {layout} runs {layout.world_size} processes: start it with "
            f"`torchrun --standalone --nproc_per_node={layout.world_size} -m genolong finetune ...` or add --launcher ray"
        )
    started = world[1] if world is not None else None
    check_layout(layout, config, seq_len=options.seq_len, batch=options.batch, world_size=started)
    if layout.cp > 1:
        from genolong.parallel.context import check_context_parallel

        check_context_parallel(config, layout)  # what the context-parallel pass refuses, before anything is built
    if (layout.cp > 1 or layout.tp > 1) and options.aux_loss_coeff > 0:
        # cp splits the sequence, and so does tp's sequence parallelism around the MoE: the
        # sequence-wise statistics would be a shard's (measured: a 2.3% larger gradient norm at tp=2).
        raise GenolongError(
            f"--aux-loss-coeff {options.aux_loss_coeff} with --parallel {layout}: the sequence-wise balance loss is not "
            "computed over a sequence split by cp or tp yet; use --aux-loss-coeff 0 (the bias rule, --balance-rate, works at any layout)"
        )
    per_rank = options.batch // layout.data_parallel
    if per_rank % options.grad_accum:
        raise GenolongError(
            f"--batch {options.batch} over {layout.data_parallel} data-parallel rank(s) is {per_rank} sequence(s) per rank, "
            f"which --grad-accum {options.grad_accum} does not divide; pick a --grad-accum that divides {per_rank}"
        )


def start(options, device: str) -> Processes:
    """This process's place in the run (module docstring); `check_processes` has passed in this
    process. Collective under torchrun."""
    world = launched_world()
    if world is None:
        return Processes(device=device)
    from genolong.parallel.mesh import build_mesh, init_distributed

    layout = requested_layout(options)
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    owns = not dist.is_initialized()
    rank, world_size = init_distributed(device_type, timeout_s=options.dist_timeout_s)
    if device_type == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    pmesh = build_mesh(layout, device_type)
    return Processes(device=device, pmesh=pmesh, rank=rank, world=world_size, owns_group=owns)
