"""`genolong plan`: the pre-flight's memory estimate for any preset, length and GPU count.

    genolong plan --seq 1M --preset glm-5.3-flash --gpus 64
    genolong plan --seq 512k --preset glm53-mini --no-offload
    genolong plan --seq 32k --preset glm53-mini --baseline

Prints the same itemised estimate that `genolong finetune` checks before allocating (GPU per GPU,
pinned host per GPU) and whether it fits; exit code 0 either way (it is a report, not a run).
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from genolong.train.options import MemoryOptions
from genolong.units import format_length, parse_length

GIB = 1024**3


def plan(
    seq: str = typer.Option("512k", "--seq", help="Tokens per sequence: 32k, 512k, 1M, ..."),
    preset: str = typer.Option("glm53-mini", "--preset", help="Model preset (glm-5.3-flash, glm53-mini, tiny)"),
    gpus: int = typer.Option(1, "--gpus", help="GPUs the sequence is split over (context parallel)"),
    gpu_gib: float = typer.Option(139.8, "--gpu-gib", help="Memory of one GPU (H200: 139.8 GiB)"),
    host_gib: float | None = typer.Option(None, "--host-gib", help="Host RAM of one node of up to 8 GPUs (default: this machine's)"),
    batch: int = typer.Option(1, "--batch", help="Sequences per micro-batch"),
    baseline: bool = typer.Option(False, "--baseline", help="Every memory optimization off"),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute", help="Full-layer activation recompute"),
    offload: bool = typer.Option(True, "--offload/--no-offload", help="Offload layer inputs to pinned host memory"),
    offload_layers: int | None = typer.Option(None, "--offload-layers", help="Layers to offload (default: as many as needed)"),
    moe_chunking: bool = typer.Option(True, "--moe-chunking/--no-moe-chunking", help="MoE in checkpointed sequence chunks"),
    moe_chunk: str = typer.Option("64k", "--moe-chunk", help="Tokens per MoE chunk"),
    chunked_loss: bool = typer.Option(True, "--chunked-loss/--no-chunked-loss", help="LM head + loss in sequence chunks"),
    mhc_low_precision: bool = typer.Option(True, "--mhc-low-precision/--no-mhc-low-precision", help="mHC projection without an fp32 input copy"),
    pinned: bool = typer.Option(True, "--pinned/--no-pinned", help="Pinned (page-locked) host buffers"),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap", help="Offload copies on their own streams (one prefetch buffer)"),
) -> None:
    """Estimate GPU and pinned host memory of one training step (the finetune pre-flight's numbers)."""
    from genolong.model import get_preset
    from genolong.train.plan import estimate_memory, fixes_for

    seq_len = parse_length(seq, "--seq")
    if baseline:
        opts = MemoryOptions.baseline()
    else:
        opts = MemoryOptions(
            recompute=recompute,
            offload=offload and recompute,
            offload_layers=offload_layers,
            moe_chunking=moe_chunking,
            moe_chunk_tokens=parse_length(moe_chunk, "--moe-chunk"),
            chunked_loss=chunked_loss,
            mhc_low_precision=mhc_low_precision,
            offload_pinned=pinned,
            offload_overlap=overlap,
        )
    config = get_preset(preset)
    gpu_bytes = int(gpu_gib * GIB)
    host_bytes = int(host_gib * GIB) if host_gib is not None else None
    est = estimate_memory(config, seq_len, opts, gpus, gpu_bytes, batch=batch, host_bytes=host_bytes)

    console = Console()
    title = f"{config.name} at {format_length(seq_len)} tokens x {batch} on {gpus} GPU(s)"
    table = Table(title=title, show_lines=False)
    table.add_column("where")
    table.add_column("item")
    table.add_column("GiB", justify="right")
    for name, value in est.gpu.items():
        table.add_row("GPU", name, f"{value / GIB:.2f}")
    table.add_row("GPU", "[bold]total[/bold]", f"[bold]{est.gpu_total / GIB:.2f}[/bold] / {est.gpu_bytes / GIB:.1f} usable")
    for name, value in est.host.items():
        table.add_row("host", name, f"{value / GIB:.2f}")
    table.add_row("host", "[bold]total pinned[/bold]", f"[bold]{est.host_total / GIB:.2f}[/bold] / {est.host_bytes / GIB:.1f} usable")
    console.print(table)
    switches = ", ".join(f"{k}={v}" for k, v in opts.to_dict().items() if k in ("recompute", "offload", "moe_chunking", "chunked_loss", "mhc_low_precision"))
    console.print(f"layers offloaded: {est.offload_layers} of {config.num_layers}; {switches}")
    transient = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.transients.items())
    if transient:
        console.print(f"transients considered (GiB, the largest is counted): {transient}")
    if est.fits:
        console.print("[green]fits[/green]")
    else:
        fixes = fixes_for(config, seq_len, opts, gpus, gpu_bytes, batch=batch, host_bytes=host_bytes)
        hint = ("it would fit with " + " or ".join(fixes)) if fixes else "no memory flag makes it fit: shorten --seq or add GPUs (--gpus)"
        console.print(f"[red]does not fit[/red]: {hint}")
