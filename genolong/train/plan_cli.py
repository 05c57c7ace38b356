"""`genolong plan`: the pre-flight's memory estimate for any preset, length, GPU count and parallel layout.

    genolong plan --seq 512k --preset glm53-mini
    genolong plan --seq 512k --preset glm53-mini --no-offload
    genolong plan --seq 32k --preset glm53-mini --baseline
    genolong plan --seq 4k --preset tiny --device cpu
    genolong plan --seq 1M --preset glm-5.3-flash --parallel cp=32,ep=2 --fsdp --gpu-type b200 --node-ram-gib 2048 --moe-chunk 16k
    genolong plan --seq 1M --preset glm-5.3-flash --gpus 64 --suggest --gpu-type b200 --moe-chunk 16k

Prints the same itemised estimate that `genolong finetune` checks before allocating (per GPU,
pinned host per GPU and per node; RAM with --device cpu) and whether it fits. Exit code 0 when it
fits, 3 when it does not, with the resource that is short and the changes that would fit, so
scripts can test it (`genolong plan ... || exit`). A layout that breaks a rule is refused in one
line before anything is planned (exit code 2).

`--parallel dp=..,cp=..,tp=..,ep=..` plans one layout (genolong/train/plan_parallel.py;
docs/parallel.md, "The plan"); `--suggest` plans every layout of `--gpus` and ranks them. `--gpus N`
alone keeps its old meaning: the sequence split N ways with everything sharded N ways
(`--parallel cp=N --fsdp`).

Names and meanings are finetune's: --batch is sequences per optimizer step (split over the dp x ep
ranks and into --grad-accum micro-batches; memory is one rank's micro-batch), --gpu-budget-gib /
--host-budget-gib are what the step may use. The old --gpu-gib / --host-gib (the machine's
memory) still work, hidden, converted to budgets with a deprecation line.
"""

from __future__ import annotations

import math

import typer
from rich.console import Console
from rich.table import Table

from genolong.train.options import MemoryOptions
from genolong.units import format_length, parse_length

GIB = 1024**3
EXIT_DOES_NOT_FIT = 3


def plan(
    ctx: typer.Context,
    seq: str = typer.Option("512k", "--seq", help="Tokens per sequence: 32k, 512k, 1M, ..."),
    preset: str = typer.Option("glm53-mini", "--preset", help="Model preset (glm-5.3-flash, glm53-mini, tiny)"),
    gpus: int | None = typer.Option(
        None, "--gpus", help="GPUs: with --suggest, the count to lay out; alone, the sequence split over them (--parallel cp=N --fsdp)", show_default=False
    ),
    parallel: str | None = typer.Option(None, "--parallel", help="Parallel layout, e.g. cp=8,ep=8 (dp, cp, tp, ep; docs/parallel.md)", show_default=False),
    suggest: bool = typer.Option(False, "--suggest", help="Plan every layout of --gpus and print the best (fit, then communication)"),
    top: int = typer.Option(8, "--top", help="Layouts --suggest prints"),
    fsdp: bool | None = typer.Option(
        None, "--fsdp/--no-fsdp", help="Shard weights, gradients and optimizer state over their replicas (a plan; --suggest tries both unless given)", show_default=False
    ),
    kda_cp: str = typer.Option("state", "--kda-cp", help="How cp splits KDA layers: state (passing) or ulysses (head split)"),
    optimizer_on_host: bool = typer.Option(False, "--optimizer-on-host", help="Keep fp32 masters and AdamW moments in host RAM (a plan: not implemented)"),
    moe_skew: float = typer.Option(4.0, "--moe-skew", help="Rows the busiest ep rank receives over the mean (real routing: ~4)"),
    gpu_type: str = typer.Option("h200", "--gpu-type", help="h100, h200, b200, or the GPU's memory in GiB"),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs sharing one node's host RAM"),
    node_ram_gib: float | None = typer.Option(None, "--node-ram-gib", help="One node's RAM, GiB (default: this machine's)", show_default=False),
    device: str = typer.Option("cuda", "--device", help="cuda (GPU + pinned host memory) or cpu (a CPU run: everything in RAM)"),
    dtype: str | None = typer.Option(None, "--dtype", help="bfloat16 or float32 (default: bfloat16 on cuda, float32 on cpu)", show_default=False),
    gpu_budget_gib: float | None = typer.Option(
        None, "--gpu-budget-gib", help="GPU memory one step may use, GiB (default: 92% of the GPU's memory)", show_default=False
    ),
    host_budget_gib: float | None = typer.Option(
        None,
        "--host-budget-gib",
        help="Host memory for offloaded layer inputs per GPU, GiB; on --device cpu, for the whole run (default: 80% of the node's RAM, shared by its GPUs)",
        show_default=False,
    ),
    batch: int | None = typer.Option(
        None, "--batch", help="Sequences per optimizer step, as in finetune (default: one per data-parallel rank and micro-batch)", show_default=False
    ),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches the step's sequences are split into (as in finetune)"),
    baseline: bool = typer.Option(False, "--baseline", help="Every memory optimization off"),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute", help="Full-layer activation recompute"),
    offload: bool = typer.Option(True, "--offload/--no-offload", help="Offload layer inputs to pinned host memory"),
    offload_layers: int | None = typer.Option(None, "--offload-layers", help="Layers to offload (default: as many as needed)"),
    keep_sparse: str = typer.Option("auto", "--keep-sparse", help="Kept DSA results under recompute: auto, host, device, off (as in finetune)"),
    moe_chunking: bool = typer.Option(True, "--moe-chunking/--no-moe-chunking", help="MoE in checkpointed sequence chunks"),
    moe_chunk: str = typer.Option("64k", "--moe-chunk", help="Tokens per MoE chunk"),
    tile: str = typer.Option("auto", "--tile", help="Each layer in sequence tiles of this many tokens (as in finetune); auto: "
                                                     "the longest tile that fits when whole layers do not (one GPU); off"),
    keep_moe: bool = typer.Option(False, "--keep-moe/--no-keep-moe", help="Kept MoE outputs under recompute (as in finetune)"),
    chunked_loss: bool = typer.Option(True, "--chunked-loss/--no-chunked-loss", help="LM head + loss in sequence chunks"),
    loss_chunk: str | None = typer.Option(None, "--loss-chunk", help="Tokens per loss chunk (default: ~1 GiB of fp32 logits)", show_default=False),
    mhc_low_precision: bool = typer.Option(True, "--mhc-low-precision/--no-mhc-low-precision", help="mHC projection without an fp32 input copy"),
    pinned: bool = typer.Option(True, "--pinned/--no-pinned", help="Pinned (page-locked) host buffers"),
    overlap: bool = typer.Option(True, "--overlap/--no-overlap", help="Offload copies on their own streams (one prefetch buffer)"),
    gpu_gib: float | None = typer.Option(None, "--gpu-gib", hidden=True),
    host_gib: float | None = typer.Option(None, "--host-gib", hidden=True),
) -> None:
    """Estimate GPU and pinned host memory (or, with --device cpu, RAM) of one training step.

    The finetune pre-flight's numbers, for one GPU or a parallel layout. Exit code 0 when it fits,
    3 when it does not (the advice names the resource that is short and what would fit).
    """
    from genolong.errors import GenolongError
    from genolong.model import get_preset
    from genolong.parallel.layout import parse_layout
    from genolong.train.plan import GPU_USABLE, HOST_USABLE, choose_tile, estimate_cpu_memory, estimate_memory
    from genolong.train.preflight import shortfall
    from genolong.train.plan_parallel import ParallelSetup, check_setup, gpu_memory_bytes, single_gpu_setup, tokens_per_gpu, traffic
    from genolong.train.plan_suggest import blockers, suggest as rank_layouts

    if device not in ("cuda", "cpu"):
        raise GenolongError(f"--device must be cuda or cpu, got {device!r}")
    for flag, value in (("--gpu-budget-gib", gpu_budget_gib), ("--host-budget-gib", host_budget_gib), ("--node-ram-gib", node_ram_gib),
                        ("--gpu-gib", gpu_gib), ("--host-gib", host_gib)):
        # `not value > 0` catches NaN; inf passes it and would overflow the byte counts.
        if value is not None and not (math.isfinite(value) and value > 0):
            raise GenolongError(f"{flag} must be a positive number of GiB, got {value}")
    if not (math.isfinite(moe_skew) and moe_skew >= 1):
        raise GenolongError(f"--moe-skew is the busiest ep rank's rows over the mean, a number >= 1; got {moe_skew}")
    if grad_accum < 1:
        raise GenolongError(f"--grad-accum must be at least 1, got {grad_accum}")
    if top < 1:
        raise GenolongError(f"--top must be at least 1, got {top}")
    layout = parse_layout(parallel) if parallel else None
    if layout is not None and layout.fsdp > 1:
        # The plan's terms have no fsdp dimension: its --fsdp shards over every replica instead.
        raise GenolongError(
            f"--parallel {layout}: the plan does not model finetune's fsdp dimension yet; plan it as dp={layout.dp * layout.fsdp} "
            "with --fsdp (sharding over every replica: a lower bound on finetune's fsdp x cp sharding)"
        )
    if device == "cpu" and (gpus not in (None, 1) or layout is not None or suggest):
        raise GenolongError("--device cpu plans one process; drop --gpus / --parallel / --suggest")
    if gpus is not None and layout is not None and gpus != layout.world_size:
        raise GenolongError(f"--gpus {gpus} does not match --parallel {layout} ({layout.world_size} GPUs); drop --gpus or make them agree")
    if suggest and gpus is None and layout is None:
        raise GenolongError("--suggest needs the number of GPUs to lay out: add --gpus N")
    world = gpus if gpus is not None else (layout.world_size if layout is not None else 1)
    setup_kw = dict(kda_mode=kda_cp, optimizer_on_host=optimizer_on_host, gpus_per_node=gpus_per_node, moe_skew=moe_skew)
    if layout is not None:
        setup = ParallelSetup(layout=layout, fsdp=bool(fsdp), **setup_kw)
    else:
        legacy = single_gpu_setup(world)
        setup = ParallelSetup(layout=legacy.layout, fsdp=legacy.fsdp if fsdp is None else fsdp, **setup_kw)

    # The spellings before 0.2 measured the machine, not the budget: converted, with a line saying so.
    if gpu_gib is not None:
        gpu_budget_gib = gpu_budget_gib if gpu_budget_gib is not None else gpu_gib * GPU_USABLE
        _deprecated("--gpu-gib", f"--gpu-budget-gib {gpu_budget_gib:.1f} ({GPU_USABLE:.0%} of {gpu_gib:g} GiB)")
    if host_gib is not None:
        host_budget_gib = host_budget_gib if host_budget_gib is not None else host_gib * HOST_USABLE / setup.gpus_on_node
        _deprecated("--host-gib", f"--host-budget-gib {host_budget_gib:.1f} ({HOST_USABLE:.0%} of {host_gib:g} GiB per node, per GPU)")
    dtype_name = dtype or ("bfloat16" if device == "cuda" else "float32")
    dtype_bytes = {"bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4}.get(dtype_name)
    if dtype_bytes is None:
        raise GenolongError(f"--dtype must be bfloat16 or float32, got {dtype_name!r}")
    ranks = setup.layout.data_parallel
    sequences = batch if batch is not None else ranks * grad_accum
    if sequences < 1 or sequences % (ranks * grad_accum):
        raise GenolongError(
            f"--batch {sequences} must be a positive multiple of {ranks * grad_accum}: the step's sequences are split over "
            f"{ranks} data-parallel rank(s) (dp x ep) and into --grad-accum {grad_accum} equal micro-batches"
        )
    micro = sequences // (ranks * grad_accum)
    gpu_bytes = gpu_memory_bytes(gpu_type) if device == "cuda" else 0  # --device cpu plans RAM only
    host_bytes = int(node_ram_gib * GIB) if node_ram_gib is not None else None

    seq_len = parse_length(seq, "--seq")
    if seq_len < 2:
        raise GenolongError(f"--seq must be at least 2 tokens (as finetune needs), got {seq_len}")
    # The budgets as converted from the deprecated spellings above; every other flag as given.
    opts = MemoryOptions.from_params(ctx.params, gpu_budget_gib=gpu_budget_gib, host_budget_gib=host_budget_gib)
    config = get_preset(preset)
    opts.check_layers(config.num_layers)
    console = Console()
    if not console.is_terminal:  # a pipe or a log: wide enough that the tables keep one line per row
        console = Console(width=160)
    if device == "cuda" and getattr(ctx.get_parameter_source("gpu_type"), "name", "") == "DEFAULT":
        import torch

        if not torch.cuda.is_available():
            # The plan is for a GPU this machine does not have: say which one it assumed.
            console.print(f"no GPU here: planned for an H200 ({gpu_memory_bytes(gpu_type) / GIB:.0f} GiB; --gpu-type h100, b200 or GiB for "
                          "another, --device cpu for a CPU run)", highlight=False)
    if device == "cpu":
        # --node-ram-gib: the machine the run is for (default: this one's RAM).
        est = estimate_cpu_memory(config, seq_len, opts, batch=micro, dtype_bytes=dtype_bytes, ram_bytes=host_bytes)
        _print_estimate(console, config, est, f"{config.name} at {format_length(seq_len)} tokens x {micro} per micro-batch on the CPU")
        _verdict(console, config, est, lambda: shortfall(config, seq_len, opts, 1, gpu_bytes, device="cpu", batch=micro, dtype_bytes=dtype_bytes, ram_bytes=host_bytes))
        return

    if suggest:
        ranked = rank_layouts(
            config, seq_len, opts, world, gpu_bytes, fsdp=fsdp, batch=batch, grad_accum=grad_accum,
            dtype_bytes=dtype_bytes, host_bytes=host_bytes, gpu_type=gpu_type.lower(), **setup_kw,
        )
        if not ranked:
            raise GenolongError(f"no layout of {world} GPUs is valid for {config.name} at {format_length(seq_len)} tokens; try another --gpus or --seq")
        _print_candidates(console, config, seq_len, ranked[:top], len(ranked), gpu_type)
        best = ranked[0]
        setup, sequences = best.setup, best.batch
        micro = sequences // (setup.layout.data_parallel * grad_accum)
        console.print(f"\nthe best: --parallel {setup.layout}" + (" --fsdp" if setup.fsdp else "") + f" (--batch {sequences})")
    else:
        check_setup(config, setup, seq_len=seq_len, batch=sequences)

    est = estimate_memory(config, seq_len, opts, gpu_bytes=gpu_bytes, batch=micro, dtype_bytes=dtype_bytes, host_bytes=host_bytes, setup=setup)
    if not est.fits and opts.tile_auto and opts.tile_tokens is None:
        tiled = choose_tile(config, seq_len, opts, 1, gpu_bytes, batch=micro, dtype_bytes=dtype_bytes, host_bytes=host_bytes, setup=setup)
        if tiled is not None:
            dropped = " and --keep-sparse off" if tiled.opts.keep_sparse != opts.keep_sparse else ""
            console.print(f"whole layers do not fit: --tile auto picks {format_length(tiled.opts.tile_tokens)} tiles{dropped}")
            est, opts = tiled, tiled.opts
    where = f"{setup.world} GPU(s)" if setup.world > 1 else "1 GPU"
    _print_estimate(console, config, est, f"{config.name} at {format_length(seq_len)} tokens x {micro} per micro-batch per GPU, {where} ({setup.describe()})")
    if setup.world > 1:
        _print_node(console, est)
        sent = traffic(config, setup, tokens_per_gpu(seq_len, micro, setup.layout), a=dtype_bytes, recompute=opts.recompute, grad_accum=grad_accum)
        _print_traffic(console, sent, gpu_type)
        if layout is None and not suggest:
            console.print(f"--gpus {world} is planned as --parallel {setup.layout}" + (" --fsdp" if setup.fsdp else "") + "; --suggest ranks every layout")
        missing = blockers(config, setup)
        if missing:
            console.print(f"[yellow]a plan[/yellow]: genolong does not run {', '.join(missing)} yet")
    _verdict(
        console, config, est,
        lambda: shortfall(config, seq_len, opts, setup.world, gpu_bytes, batch=micro, dtype_bytes=dtype_bytes, host_bytes=host_bytes, setup=setup),
    )


def _verdict(console: Console, config, est, fixes) -> None:
    if est.fits:
        console.print("[green]fits[/green]")
        return
    console.print(f"[red]does not fit[/red]: {' and '.join(est.short)} short")
    found = fixes()
    for fix in found:
        console.print(f"  would fit with {fix}")
    if not found:
        console.print("  no flag or shorter --seq makes it fit: a smaller model (--preset) or more GPUs (--gpus N --suggest)")
    raise typer.Exit(EXIT_DOES_NOT_FIT)


def _print_estimate(console: Console, config, est, title: str) -> None:
    cpu = est.device == "cpu"
    where = "RAM" if cpu else "GPU"
    table = Table(title=title, show_lines=False)
    table.add_column("where")
    table.add_column("item")
    table.add_column("GiB", justify="right")
    for name, value in est.gpu.items():
        table.add_row(where, name, f"{value / GIB:.2f}")
    table.add_row(where, "[bold]total[/bold]", f"[bold]{est.gpu_total / GIB:.2f}[/bold] / {est.gpu_bytes / GIB:.1f} usable")
    if not cpu:
        for name, value in est.host.items():
            table.add_row("host", name, f"{value / GIB:.2f}")
        table.add_row("host", "[bold]total pinned[/bold]", f"[bold]{est.host_total / GIB:.2f}[/bold] / {est.host_bytes / GIB:.1f} usable")
    console.print(table)
    switches = ", ".join(f"{k}={v}" for k, v in est.opts.to_dict().items() if k in ("recompute", "offload", "moe_chunking", "chunked_loss", "mhc_low_precision", "tile_tokens", "keep_sparse"))
    console.print(switches if cpu else f"layers offloaded: {est.offload_layers} of {config.num_layers}; {switches}")
    transient = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.transients.items())
    if transient:
        console.print(f"transients considered (GiB, the largest is counted): {transient}")


def _print_node(console: Console, est) -> None:
    gpus = est.setup.gpus_on_node
    table = Table(title=f"host memory of one node ({gpus} GPUs)")
    table.add_column("item")
    table.add_column("GiB", justify="right")
    for name, value in est.node_host.items():
        table.add_row(name, f"{value / GIB:.1f}")
    table.add_row("[bold]total[/bold]", f"[bold]{sum(est.node_host.values()) / GIB:.1f}[/bold] / {est.host_bytes * gpus / GIB:.1f} usable")
    console.print(table)


def _print_traffic(console: Console, sent, gpu_type: str) -> None:
    table = Table(title="bytes each GPU sends per optimizer step (estimate)")
    table.add_column("collective")
    table.add_column("GB", justify="right")
    table.add_column("across nodes")
    for name, (nbytes, across) in sent.items.items():
        table.add_row(name, f"{nbytes / 1e9:.1f}", "yes" if across else "")
    console.print(table)
    console.print(f"~{sent.seconds(gpu_type.lower()):.1f} s of communication per step at spec link speeds, without overlap (a ranking, not a measurement)")


def _print_candidates(console: Console, config, seq_len: int, shown: list, total: int, gpu_type: str) -> None:
    first = shown[0].estimate
    title = (
        f"{config.name} at {format_length(seq_len)} tokens on {shown[0].setup.world} GPUs ({gpu_type}, {first.gpu_bytes / GIB:.1f} GiB usable, "
        f"host {first.host_bytes * shown[0].setup.gpus_on_node / GIB:.0f} GiB usable per node): {total} layouts planned, the best {len(shown)}"
    )
    table = Table(title=title)
    for name in ("layout", "fsdp", "seqs", "fits", "peak GiB", "offl.", "host/node GiB", "sent GB", "comm s", "runs today"):
        table.add_column(name, justify="left" if name in ("layout", "fsdp", "fits", "runs today") else "right")
    for c in shown:
        est = c.estimate
        table.add_row(
            _short(c.setup.layout),
            "yes" if c.setup.fsdp else "",
            str(c.batch),
            "yes" if c.fits else "no",
            f"{est.gpu_total / GIB:.1f}",
            str(est.offload_layers),
            f"{sum(est.node_host.values()) / GIB:.0f}",
            f"{c.traffic.total / 1e9:.0f}",
            f"{c.seconds:.1f}",
            "yes" if not c.blockers else "no: " + ", ".join(_BLOCKER_SHORT.get(b, b) for b in c.blockers),
        )
    console.print(table)
    console.print(
        "seqs: sequences per step (one per data-parallel rank unless --batch); offl.: layers offloaded; comm s: at spec link "
        "speeds, a ranking; runs today: what genolong does not run yet (tp+cp: tp with cp, cp: context parallelism)"
    )


_BLOCKER_SHORT = {"tp with cp": "tp+cp", "context parallelism": "cp", "FSDP": "fsdp", "optimizer state on host": "opt. on host"}


def _short(layout) -> str:
    """cp=8,ep=8 for dp=1,cp=8,tp=1,ep=8 (every size 1 left out)."""
    parts = [f"{name}={getattr(layout, name)}" for name in ("dp", "cp", "tp", "ep") if getattr(layout, name) > 1]
    return ",".join(parts) or "1 GPU"


def _deprecated(old: str, new: str) -> None:
    typer.echo(f"genolong: {old} is deprecated; use {new}", err=True)
