"""`genolong plan --suggest`: every layout of a GPU count, planned, ranked by fit and communication.

For `world` GPUs it enumerates dp x cp x tp x ep = world that `check_layout` accepts for the run
(tp dividing the heads and MLP widths, ep the experts, the sequence splitting into whole KDA
chunks and indexer pools), with and without FSDP unless one is asked for, plans each with
`estimate_memory`, and ranks them: layouts that fit first, then by the estimated seconds of
communication per step at spec link speeds (genolong.train.plan_parallel.traffic: a ranking, not
a prediction), then by peak memory. Without `--batch` each layout reads one sequence per
data-parallel rank (dp x ep sequences per step), as finetune would need at least.

Each candidate also says what keeps genolong from running it today (`blockers`), so a plan for
the real model is not mistaken for a run that works.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from genolong.errors import GenolongError
from genolong.model.config import ModelConfig
from genolong.parallel.layout import ParallelLayout, check_layout
from genolong.train.options import MemoryOptions
from genolong.train.plan import H200_BYTES, MemoryEstimate, estimate_memory
from genolong.train.plan_parallel import ParallelSetup, Traffic, tokens_per_gpu, traffic


@dataclass
class Candidate:
    setup: ParallelSetup
    batch: int  # sequences per optimizer step (all data-parallel ranks)
    estimate: MemoryEstimate
    traffic: Traffic
    seconds: float  # estimated communication per step (ranking only)
    blockers: list[str]

    @property
    def fits(self) -> bool:
        return self.estimate.fits


def blockers(config: ModelConfig, setup: ParallelSetup) -> list[str]:
    """What genolong cannot run of this setup yet, one phrase each (empty: it runs)."""
    from genolong.parallel.tensor import check_tensor_parallel

    out = []
    lay = setup.layout
    try:
        check_tensor_parallel(config, lay)
    except GenolongError:
        out.append("tp at these widths")
    if lay.cp > 1 and importlib.util.find_spec("genolong.parallel.context") is None:
        out.append("context parallelism")
    if setup.sharded:
        out.append("FSDP")
    if setup.optimizer_on_host:
        out.append("optimizer state on host")
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(config: ModelConfig, world: int, seq_len: int, *, batch: int | None = None, grad_accum: int = 1) -> list[ParallelLayout]:
    """Every layout of `world` GPUs that check_layout accepts for this model and length."""
    from genolong.parallel.tensor import check_tensor_parallel

    found = []
    for tp in _divisors(world):
        for ep in _divisors(world // tp):
            for cp in _divisors(world // (tp * ep)):
                layout = ParallelLayout(dp=world // (tp * ep * cp), cp=cp, tp=tp, ep=ep)
                sequences = batch if batch is not None else layout.data_parallel * grad_accum
                try:
                    check_layout(layout, config, seq_len=seq_len, batch=sequences)
                    check_tensor_parallel(config, layout)  # the widths tp must divide beyond the heads
                except GenolongError:
                    continue
                if sequences % (layout.data_parallel * grad_accum):
                    continue
                found.append(layout)
    return found


def suggest(
    config: ModelConfig,
    seq_len: int,
    opts: MemoryOptions,
    world: int,
    gpu_bytes: int = H200_BYTES,
    *,
    fsdp: bool | None = None,
    kda_mode: str = "state",
    optimizer_on_host: bool = False,
    gpus_per_node: int = 8,
    moe_skew: float = 4.0,
    batch: int | None = None,
    micro_batch: int = 1,
    grad_accum: int = 1,
    dtype_bytes: int = 2,
    host_bytes: int | None = None,
    gpu_type: str = "h200",
) -> list[Candidate]:
    """Every valid layout of `world` GPUs, planned and ranked best first (module docstring).

    batch: sequences per optimizer step; None: `micro_batch` per data-parallel rank and micro-batch."""
    if world < 1:
        raise GenolongError(f"--gpus must be >= 1, got {world}")
    out = []
    for layout in layouts(config, world, seq_len, batch=batch, grad_accum=grad_accum):
        if kda_mode == "ulysses" and layout.cp > 1 and config.kda.num_heads % (layout.cp * layout.tp):
            continue
        sequences = batch if batch is not None else layout.data_parallel * grad_accum * micro_batch
        micro = sequences // (layout.data_parallel * grad_accum)
        for sharded in ([fsdp] if fsdp is not None else [False, True]):
            if sharded and world == 1:
                continue
            setup = ParallelSetup(
                layout=layout, fsdp=sharded, kda_mode=kda_mode, optimizer_on_host=optimizer_on_host, gpus_per_node=gpus_per_node, moe_skew=moe_skew
            )
            est = estimate_memory(config, seq_len, opts, gpu_bytes=gpu_bytes, batch=micro, dtype_bytes=dtype_bytes, host_bytes=host_bytes, setup=setup)
            sent = traffic(config, setup, tokens_per_gpu(seq_len, micro, layout), a=dtype_bytes, recompute=opts.recompute, grad_accum=grad_accum)
            out.append(Candidate(setup, sequences, est, sent, sent.seconds(gpu_type), blockers(config, setup)))
    out.sort(key=lambda c: (not c.fits, c.seconds, c.estimate.gpu_total))
    return out


def fewest_gpus(config: ModelConfig, seq_len: int, opts: MemoryOptions, more_than: int, gpu_bytes: int, *, limit: int = 1024, **kw) -> Candidate | None:
    """The best layout on the fewest GPUs (powers of two above `more_than`, up to `limit`) that fits, or None."""
    world = 1
    while world <= limit:
        if world > more_than:
            ranked = suggest(config, seq_len, opts, world, gpu_bytes, **kw)
            if ranked and ranked[0].fits:
                return ranked[0]
        world *= 2
    return None
