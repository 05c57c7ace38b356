"""`genolong plan`: the pre-flight's memory estimate for any preset, length and GPU count.

    genolong plan --seq 1M --preset glm-5.3-flash --gpus 64
    genolong plan --seq 512k --preset glm53-mini --no-offload
    genolong plan --seq 32k --preset glm53-mini --baseline
    genolong plan --seq 4k --preset tiny --device cpu

Prints the same itemised estimate that `genolong finetune` checks before allocating (GPU per GPU,
pinned host per GPU; RAM with --device cpu) and whether it fits. Exit code 0 when it fits, 3 when
it does not, with the resource that is short and the changes that would fit, so scripts can
test it (`genolong plan ... || exit`).

Names and meanings are finetune's: --batch is sequences per optimizer step (split into
--grad-accum micro-batches; memory is the micro-batch's), --gpu-budget-gib / --host-budget-gib
are what the step may use. The old --gpu-gib / --host-gib (the machine's memory) still work,
hidden, converted to budgets with a deprecation line.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from genolong.train.options import MemoryOptions
from genolong.units import format_length, parse_length

GIB = 1024**3
EXIT_DOES_NOT_FIT = 3


def plan(
    seq: str = typer.Option("512k", "--seq", help="Tokens per sequence: 32k, 512k, 1M, ..."),
    preset: str = typer.Option("glm53-mini", "--preset", help="Model preset (glm-5.3-flash, glm53-mini, tiny)"),
    gpus: int = typer.Option(1, "--gpus", help="GPUs the sequence is split over (context parallel; a plan: finetune trains on one GPU)"),
    device: str = typer.Option("cuda", "--device", help="cuda (GPU + pinned host memory) or cpu (a CPU run: everything in RAM)"),
    dtype: str | None = typer.Option(None, "--dtype", help="bfloat16 or float32 (default: bfloat16 on cuda, float32 on cpu)", show_default=False),
    gpu_budget_gib: float | None = typer.Option(
        None, "--gpu-budget-gib", help="GPU memory one step may use, GiB (default: 92% of an H200's 139.8 GiB)", show_default=False
    ),
    host_budget_gib: float | None = typer.Option(
        None,
        "--host-budget-gib",
        help="Host memory for offloaded layer inputs per GPU, GiB; on --device cpu, for the whole run (default: 80% of this machine's RAM, shared by up to 8 GPUs)",
        show_default=False,
    ),
    batch: int = typer.Option(1, "--batch", help="Sequences per optimizer step (as in finetune)"),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches the step's sequences are split into (as in finetune)"),
    baseline: bool = typer.Option(False, "--baseline", help="Every memory optimization off"),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute", help="Full-layer activation recompute"),
    offload: bool = typer.Option(True, "--offload/--no-offload", help="Offload layer inputs to pinned host memory"),
    offload_layers: int | None = typer.Option(None, "--offload-layers", help="Layers to offload (default: as many as needed)"),
    moe_chunking: bool = typer.Option(True, "--moe-chunking/--no-moe-chunking", help="MoE in checkpointed sequence chunks"),
    moe_chunk: str = typer.Option("64k", "--moe-chunk", help="Tokens per MoE chunk"),
    chunked_loss: bool = typer.Option(True, "--chunked-loss/--no-chunked-loss", help="LM head + loss in sequence chunks"),
    loss_chunk: str | None = typer.Option(None, "--loss-chunk", help="Tokens per loss chunk (default: ~1 GiB of fp32 logits)", show_default=False),
    mhc_low_precision: bool = typer.Option(True, "--mhc-low-precision/--no-mhc-low-precision", help="mHC projection without an fp32 input copy"),
    pinned: bool = typer.Option(True, "--pinned/--no-pinned", help="Pinned (page-locked) host buffers"),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap", help="Offload copies on their own streams (one prefetch buffer)"),
    gpu_gib: float | None = typer.Option(None, "--gpu-gib", hidden=True),
    host_gib: float | None = typer.Option(None, "--host-gib", hidden=True),
) -> None:
    """Estimate GPU and pinned host memory (or, with --device cpu, RAM) of one training step.

    The finetune pre-flight's numbers. Exit code 0 when it fits, 3 when it does not (the advice
    names the resource that is short and what would fit).
    """
    from genolong.errors import GenolongError
    from genolong.model import get_preset
    from genolong.train.plan import (
        GPU_USABLE,
        GPUS_PER_HOST,
        H200_BYTES,
        HOST_USABLE,
        estimate_cpu_memory,
        estimate_memory,
        shortfall,
    )

    # The spellings before 0.2 measured the machine, not the budget: converted, with a line saying so.
    if gpu_gib is not None:
        gpu_budget_gib = gpu_budget_gib if gpu_budget_gib is not None else gpu_gib * GPU_USABLE
        _deprecated("--gpu-gib", f"--gpu-budget-gib {gpu_budget_gib:.1f} ({GPU_USABLE:.0%} of {gpu_gib:g} GiB)")
    if host_gib is not None:
        host_budget_gib = host_budget_gib if host_budget_gib is not None else host_gib * HOST_USABLE / min(gpus, GPUS_PER_HOST)
        _deprecated("--host-gib", f"--host-budget-gib {host_budget_gib:.1f} ({HOST_USABLE:.0%} of {host_gib:g} GiB per node, per GPU)")
    if device not in ("cuda", "cpu"):
        raise GenolongError(f"--device must be cuda or cpu, got {device!r}")
    if batch < 1 or grad_accum < 1 or batch % grad_accum:
        raise GenolongError(f"--batch {batch} must be a positive multiple of --grad-accum {grad_accum} (the step's sequences are split into equal micro-batches)")
    dtype_name = dtype or ("bfloat16" if device == "cuda" else "float32")
    dtype_bytes = {"bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4}.get(dtype_name)
    if dtype_bytes is None:
        raise GenolongError(f"--dtype must be bfloat16 or float32, got {dtype_name!r}")
    micro = batch // grad_accum

    seq_len = parse_length(seq, "--seq")
    memory_fields = {
        "offload_layers": offload_layers,
        "moe_chunk_tokens": parse_length(moe_chunk, "--moe-chunk"),
        "loss_chunk_tokens": parse_length(loss_chunk, "--loss-chunk") if loss_chunk else None,
        "gpu_budget_gib": gpu_budget_gib,
        "host_budget_gib": host_budget_gib,
    }
    if baseline:
        opts = MemoryOptions.baseline(**memory_fields)
    else:
        opts = MemoryOptions(
            recompute=recompute,
            offload=offload and recompute,
            moe_chunking=moe_chunking,
            chunked_loss=chunked_loss,
            mhc_low_precision=mhc_low_precision,
            offload_pinned=pinned,
            offload_overlap=overlap,
            **memory_fields,
        )
    config = get_preset(preset)
    if device == "cpu":
        if gpus != 1:
            raise GenolongError("--device cpu plans one process; drop --gpus")
        est = estimate_cpu_memory(config, seq_len, opts, batch=micro, dtype_bytes=dtype_bytes)
    else:
        est = estimate_memory(config, seq_len, opts, gpus, H200_BYTES, batch=micro, dtype_bytes=dtype_bytes)

    console = Console()
    where = "RAM" if device == "cpu" else "GPU"
    title = f"{config.name} at {format_length(seq_len)} tokens x {micro} per micro-batch on {'the CPU' if device == 'cpu' else f'{gpus} GPU(s)'}"
    table = Table(title=title, show_lines=False)
    table.add_column("where")
    table.add_column("item")
    table.add_column("GiB", justify="right")
    for name, value in est.gpu.items():
        table.add_row(where, name, f"{value / GIB:.2f}")
    table.add_row(where, "[bold]total[/bold]", f"[bold]{est.gpu_total / GIB:.2f}[/bold] / {est.gpu_bytes / GIB:.1f} usable")
    if device != "cpu":
        for name, value in est.host.items():
            table.add_row("host", name, f"{value / GIB:.2f}")
        table.add_row("host", "[bold]total pinned[/bold]", f"[bold]{est.host_total / GIB:.2f}[/bold] / {est.host_bytes / GIB:.1f} usable")
    console.print(table)
    switches = ", ".join(f"{k}={v}" for k, v in opts.to_dict().items() if k in ("recompute", "offload", "moe_chunking", "chunked_loss", "mhc_low_precision"))
    if device != "cpu":
        console.print(f"layers offloaded: {est.offload_layers} of {config.num_layers}; {switches}")
    else:
        console.print(switches)
    transient = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.transients.items())
    if transient:
        console.print(f"transients considered (GiB, the largest is counted): {transient}")
    if gpus > 1:
        console.print(f"[yellow]a plan[/yellow]: {gpus} GPUs assume context parallelism, which genolong does not run yet")
    if est.fits:
        console.print("[green]fits[/green]")
        return
    fixes = shortfall(
        config, seq_len, opts, gpus, H200_BYTES, device=device, batch=micro, dtype_bytes=dtype_bytes
    )
    console.print(f"[red]does not fit[/red]: {' and '.join(est.short)} short")
    for fix in fixes or ["nothing short of a smaller model (--preset)"]:
        console.print(f"  would fit with {fix}")
    raise typer.Exit(EXIT_DOES_NOT_FIT)


def _deprecated(old: str, new: str) -> None:
    typer.echo(f"genolong: {old} is deprecated; use {new}", err=True)
