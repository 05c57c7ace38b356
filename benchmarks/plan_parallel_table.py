"""The docs/parallel.md plan table: glm-5.3-flash at 1M tokens per sequence on 16, 32 and 64 GPUs.

    python benchmarks/plan_parallel_table.py                 # markdown on stdout (CPU, ~1 min)
    python benchmarks/plan_parallel_table.py --gpus 64 --gpu-types b200 --top 5

For each GPU count and GPU type, `genolong plan --suggest` (genolong.train.plan_suggest) with the
optimizer state on the GPU and, as a second row, in host RAM (a plan: not implemented), prints
the layouts that fit, best first, or, when none does, the one that comes closest. Settings: MoE
chunks of 16k tokens with the busiest ep rank receiving 4x the mean rows, 8 GPUs and 2 TiB of RAM
per node (80% usable), KDA split by state passing, bf16 with fp32 masters. No GPU is used: these
are plans, not measurements.
"""

from __future__ import annotations

import argparse

from genolong.model import get_preset
from genolong.train.options import MemoryOptions
from genolong.train.plan import GIB
from genolong.train.plan_parallel import gpu_memory_bytes
from genolong.train.plan_suggest import suggest
from genolong.units import parse_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="1M")
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--gpus", default="16,32,64")
    ap.add_argument("--gpu-types", default="h100,h200,b200")
    ap.add_argument("--node-ram-gib", type=float, default=2048.0)
    ap.add_argument("--moe-chunk", default="16k")
    ap.add_argument("--top", type=int, default=3, help="fitting layouts shown per row")
    args = ap.parse_args()

    config = get_preset(args.preset)
    seq = parse_length(args.seq)
    opts = MemoryOptions(moe_chunk_tokens=parse_length(args.moe_chunk))
    print(f"{config.name}, {args.seq} tokens per sequence, --moe-chunk {args.moe_chunk}, {args.node_ram_gib:g} GiB RAM per 8-GPU node\n")
    print("| GPUs | GPU (usable GiB) | optimizer state | layouts that fit, best first: layout (sequences/step): peak GiB, layers offloaded, host GiB per node |")
    print("|---|---|---|---|")
    for world in (int(g) for g in args.gpus.split(",")):
        for gpu_type in args.gpu_types.split(","):
            gpu_bytes = gpu_memory_bytes(gpu_type)
            for on_host in (False, True):
                ranked = suggest(
                    config, seq, opts, world, gpu_bytes, optimizer_on_host=on_host, host_bytes=int(args.node_ram_gib * GIB), gpu_type=gpu_type
                )
                fits = [c for c in ranked if c.fits]
                if fits:
                    cells = [_cell(c) for c in fits[: args.top]] + ([f"{len(fits) - args.top} more"] if len(fits) > args.top else [])
                else:
                    closest = min(ranked, key=lambda c: c.estimate.gpu_total + max(0, c.estimate.host_total - c.estimate.host_bytes))
                    cells = [f"none; closest {_cell(closest)}, short: {', '.join(closest.estimate.short)}"]
                where = "host RAM (plan)" if on_host else "GPU"
                usable = gpu_bytes * 0.92 / GIB
                print(f"| {world} | {gpu_type.upper()} ({usable:.0f}) | {where} | {'; '.join(cells)} |")


def _cell(c) -> str:
    est = c.estimate
    layout = ",".join(f"{d}={getattr(c.setup.layout, d)}" for d in ("dp", "cp", "tp", "ep") if getattr(c.setup.layout, d) > 1)
    fsdp = " fsdp" if c.setup.fsdp else ""
    node = sum(est.node_host.values()) / GIB
    return f"`{layout}{fsdp}` ({c.batch}): {est.gpu_total / GIB:.0f}, {est.offload_layers}, {node:.0f}"


if __name__ == "__main__":
    main()
