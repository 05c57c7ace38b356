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

from genolong.train.flags import MEMORY, Flag, flag_section, memory_options, with_flags
from genolong.units import format_length, parse_length

GIB = 1024**3
EXIT_DOES_NOT_FIT = 3


# plan's own flags; the model, length, dtype, micro-batch and memory flags are finetune's (genolong.train.flags).
OWN = flag_section(
    Flag("gpus", int | None, None, "GPUs: with --suggest, the count to lay out; alone, the sequence split over them (--parallel cp=N --fsdp)",
         show_default=False),
    Flag("parallel", str | None, None, "Parallel layout, e.g. cp=8,ep=8 (dp, cp, tp, ep; docs/parallel.md)", show_default=False),
    Flag("suggest", bool, False, "Plan every layout of --gpus and print the best (fit, then communication)", decls=("--suggest",)),
    Flag("top", int, 8, "Layouts --suggest prints"),
    Flag("fsdp", bool | None, None, "Shard weights, gradients and optimizer state over their replicas (a plan; --suggest tries both unless given)",
         decls=("--fsdp/--no-fsdp",), show_default=False),
    Flag("kda_cp", str, "state", "How cp splits KDA layers: state (passing) or ulysses (head split)"),
    Flag("optimizer_on_host", bool, False, "Keep fp32 masters and AdamW moments in host RAM (a plan: not implemented)", decls=("--optimizer-on-host",)),
    Flag("moe_skew", float, 4.0, "Rows the busiest ep rank receives over the mean (real routing: ~4)"),
    Flag("gpu_type", str, "h200", "h100, h200, b200, or the GPU's memory in GiB"),
    Flag("gpus_per_node", int, 8, "GPUs sharing one node's host RAM"),
    Flag("node_ram_gib", float | None, None, "One node's RAM, GiB (default: this machine's)", show_default=False),
    Flag("device", str, "cuda", "cuda (GPU + pinned host memory) or cpu (a CPU run: everything in RAM)"),
    Flag("batch", int | None, None, "Sequences per optimizer step, as in finetune (default: one per data-parallel rank and micro-batch)",
         show_default=False),
    # The spellings before 0.2: the machine's memory, converted to budgets with a deprecation line.
    Flag("gpu_gib", float | None, None, hidden=True),
    Flag("host_gib", float | None, None, hidden=True),
)
PLAN = ("seq", "preset", "gpus", "parallel", "suggest", "top", "fsdp", "kda_cp", "optimizer_on_host", "moe_skew", "gpu_type", "gpus_per_node",
        "node_ram_gib", "device", "dtype", "batch", "grad_accum", *MEMORY, "gpu_gib", "host_gib")


@with_flags(PLAN, OWN)
def plan(
    ctx: typer.Context,
    *,
    seq: str,
    preset: str,
    gpus: int | None,
    parallel: str | None,
    suggest: bool,
    top: int,
    fsdp: bool | None,
    kda_cp: str,
    optimizer_on_host: bool,
    moe_skew: float,
    gpu_type: str,
    gpus_per_node: int,
    node_ram_gib: float | None,
    device: str,
    dtype: str | None,
    batch: int | None,
    grad_accum: int,
    gpu_budget_gib: float | None,
    host_budget_gib: float | None,
    gpu_gib: float | None,
    host_gib: float | None,
    **memory_flags: object,
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
    opts = memory_options(ctx.params, gpu_budget_gib=gpu_budget_gib, host_budget_gib=host_budget_gib)
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
    switches = ", ".join(f"{k}={v}" for k, v in est.opts.to_dict().items() if k in ("recompute", "offload", "moe_chunking", "chunked_loss", "mhc_low_precision", "tile_tokens", "keep_sparse", "layer_inputs"))
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
        "speeds, a ranking; runs today: what genolong does not run yet (tp: tp at these widths, cp: context parallelism)"
    )


_BLOCKER_SHORT = {"tp at these widths": "tp", "context parallelism": "cp", "FSDP": "fsdp", "optimizer state on host": "opt. on host"}


def _short(layout) -> str:
    """cp=8,ep=8 for dp=1,cp=8,tp=1,ep=8 (every size 1 left out)."""
    parts = [f"{name}={getattr(layout, name)}" for name in ("dp", "cp", "tp", "ep") if getattr(layout, name) > 1]
    return ",".join(parts) or "1 GPU"


def _deprecated(old: str, new: str) -> None:
    typer.echo(f"genolong: {old} is deprecated; use {new}", err=True)
