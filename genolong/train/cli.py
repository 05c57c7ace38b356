"""`genolong finetune` (this file) and `genolong plan` (genolong.train.plan_cli)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from genolong.errors import GenolongError
from genolong.train.resume_flags import changeable_flags
from genolong.train.plan_cli import plan  # noqa: F401  (mounted by genolong.cli)

_MEM = "Memory optimizations (each one can be turned off; --baseline: all off)"
_RUN = "Run"
_IDX = "DSA indexer training (default: frozen)"
_BAL = "Expert balance and loss weighting"


def finetune(
    ctx: typer.Context,
    data: Annotated[str | None, typer.Option(help="A directory written by `genolong prepare`.", show_default=False)] = None,
    seq: Annotated[str, typer.Option(help="Tokens per sequence: 512k, 1M, 32k, 4096 (k = 1024).")] = "512k",
    preset: Annotated[str, typer.Option(help="Model preset to train from scratch: glm53-mini, glm-5.3-flash, tiny.")] = "glm53-mini",
    model: Annotated[
        str | None,
        typer.Option(help="A transformers glm5_next checkpoint directory to fine-tune (overrides --preset).", show_default=False),
    ] = None,
    out: Annotated[str | None, typer.Option(help="Run directory (log, checkpoints).", show_default=False)] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue the run in this directory from its latest complete checkpoint with its own options; only "
            f"{changeable_flags()} can change.",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an earlier run in --out (e.g. one interrupted before its first checkpoint); never other data."),
    ] = False,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 80,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW).")] = 1e-4,
    warmup: Annotated[int, typer.Option(help="Linear warmup steps before the cosine decay.")] = 10,
    min_lr_ratio: Annotated[float, typer.Option(help="Cosine floor as a fraction of --lr.")] = 0.1,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay (matrices only).")] = 0.1,
    grad_clip: Annotated[float, typer.Option(help="Max global gradient norm (0: no clipping).")] = 1.0,
    batch: Annotated[int, typer.Option(help="Sequences per optimizer step.")] = 1,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches the step's sequences are split into.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the model init, the window sampler and the RNGs.")] = 0,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps (0: only at the end).")] = 0,
    keep_last: Annotated[int, typer.Option(help="Complete checkpoints to keep.")] = 2,
    stop_after: Annotated[
        int | None, typer.Option(help="End this invocation after N steps, checkpointed (continue with --resume).", show_default=False)
    ] = None,
    overfit: Annotated[int, typer.Option(help="Train repeatedly on a fixed set of N windows (a correctness check).")] = 0,
    max_n_fraction: Annotated[float, typer.Option(help="Skip windows with a larger fraction of N bases.")] = 0.1,
    planted_repeats: Annotated[
        str | None,
        typer.Option(
            help="Train on windows with planted repeats (copies of L bases placed d bases later), e.g. "
            "len=64,max-dist=48k,per-window=8 (docs/recall.md). Off by default.",
            show_default=False,
        ),
    ] = None,
    kernels: Annotated[
        str | None,
        typer.Option(help="Hot-op policy: fused (fail loudly on a fallback), auto, reference (default: fused on CUDA, reference on CPU).", show_default=False),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cuda:1, cpu (default: cuda if available).", show_default=False)] = None,
    dtype: Annotated[str | None, typer.Option(help="bfloat16 or float32 parameters (default: bfloat16 on CUDA, float32 on CPU).", show_default=False)] = None,
    launcher: Annotated[str, typer.Option(help="local (a spawned worker process) or ray (one Ray actor per rank). Under torchrun every rank runs in its own process.")] = "local",
    ray_address: Annotated[str | None, typer.Option(help="Ray cluster address (default: start a local Ray).", show_default=False)] = None,
    parallel: Annotated[
        str | None,
        typer.Option(help="Parallel layout, e.g. cp=2, dp=2,tp=4 or fsdp=2,cp=2,ep=2 (dp, fsdp, cp, tp, ep; fsdp: FSDP2 over fsdp x cp; default: one process, or dp = the processes torchrun started). docs/parallel.md.", show_default=False),
    ] = None,
    dist_timeout_s: Annotated[float, typer.Option(help="Seconds a collective waits for a missing rank before the run fails.")] = 1800.0,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
    compile: Annotated[
        bool | None,
        typer.Option("--compile/--no-compile", help="torch.compile the small ops: norms, router, SwiGLU (and mHC, except on the GPU, where its "
                                                    "fused kernels run). Default: on with the fused kernels on CUDA, off elsewhere.", show_default=False),
    ] = None,
    recompute: Annotated[bool, typer.Option("--recompute/--no-recompute", help="Full-layer activation recompute (off also turns offload off).", rich_help_panel=_MEM)] = True,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="Layer inputs to pinned host memory.", rich_help_panel=_MEM)] = True,
    offload_layers: Annotated[
        int | None, typer.Option(help="Layers that offload (default: as many as the GPU budget needs).", rich_help_panel=_MEM, show_default=False)
    ] = None,
    keep_sparse: Annotated[
        str,
        typer.Option(help="Under recompute, keep the DSA selections and sparse-attention results from the forward instead of "
                          "recomputing them: host (pinned memory), device, off; auto = host with --offload, else device.", rich_help_panel=_MEM),
    ] = "auto",
    pinned: Annotated[bool, typer.Option("--pinned/--no-pinned", help="Pinned (page-locked) host buffers.", rich_help_panel=_MEM)] = True,
    overlap: Annotated[bool, typer.Option("--overlap/--no-overlap", help="Offload copies on their own streams.", rich_help_panel=_MEM)] = True,
    moe_chunking: Annotated[bool, typer.Option("--moe-chunking/--no-moe-chunking", help="MoE in sequence chunks.", rich_help_panel=_MEM)] = True,
    moe_chunk: Annotated[str, typer.Option(help="Tokens per MoE chunk.", rich_help_panel=_MEM)] = "64k",
    tile: Annotated[
        str,
        typer.Option(help="Each layer runs the sequence in checkpointed tiles of this many tokens (KDA state carried, DSA "
                          "queries against the whole keys; the MoE per tile, unchunked). auto: on CUDA, the longest tile that "
                          "makes the plan fit when whole layers do not; off: whole layers.", rich_help_panel=_MEM),
    ] = "auto",
    keep_moe: Annotated[
        bool,
        typer.Option("--keep-moe/--no-keep-moe", help="Under recompute, keep each chunked MoE's output from the forward: two MoE "
                                                     "forwards a step instead of three, for hidden x 2 bytes a token and MoE layer "
                                                     "where --keep-sparse keeps (opt-in: -0.14 s of a 6.5 s 128k step on an H100; +5 GiB pinned at 128k, +21 at 512k).", rich_help_panel=_MEM),
    ] = False,
    mhc_low_precision: Annotated[
        bool, typer.Option("--mhc-low-precision/--no-mhc-low-precision", help="mHC projection without an fp32 input copy.", rich_help_panel=_MEM)
    ] = True,
    chunked_loss: Annotated[
        bool, typer.Option("--chunked-loss/--no-chunked-loss", help="LM head + loss in chunks (no [T, vocab] logits).", rich_help_panel=_MEM)
    ] = True,
    loss_chunk: Annotated[
        str | None, typer.Option(help="Tokens per loss chunk (default: ~1 GiB of fp32 logits).", rich_help_panel=_MEM, show_default=False)
    ] = None,
    gpu_budget_gib: Annotated[
        float | None, typer.Option(help="GPU memory the step may use, GiB (default: 92% of the device's).", rich_help_panel=_MEM, show_default=False)
    ] = None,
    host_budget_gib: Annotated[
        float | None,
        typer.Option(help="Host memory for offloaded layer inputs, GiB; on the CPU, for the whole run (default: 80% of the machine's RAM).", rich_help_panel=_MEM, show_default=False),
    ] = None,
    gpu_budget: Annotated[float | None, typer.Option(hidden=True)] = None,
    host_budget: Annotated[float | None, typer.Option(hidden=True)] = None,
    baseline: Annotated[bool, typer.Option("--baseline", help="Every memory optimization off (the stack out of the box).", rich_help_panel=_MEM)] = False,
    balance_rate: Annotated[
        float, typer.Option(help="Expert-balance bias step per optimizer step (DeepSeek-V3's auxiliary-loss-free balancing; 0: off; 1e-2 undoes a from-scratch run's early collapse faster, docs/training.md).", rich_help_panel=_BAL)
    ] = 1e-3,
    aux_loss_coeff: Annotated[float, typer.Option(help="Sequence-wise expert balance loss coefficient (DeepSeek-V3; 0: off, e.g. 1e-4).", rich_help_panel=_BAL)] = 0.0,
    repeat_weight: Annotated[float, typer.Option(help="Loss weight of soft-masked repeat bases (1: as others; Evo 2 uses 0.1).", rich_help_panel=_BAL)] = 1.0,
    indexer_loss_coeff: Annotated[
        float, typer.Option(help="Train the DSA indexer with its KL loss at this weight (0: frozen indexer).", rich_help_panel=_IDX)
    ] = 0.0,
    indexer_warmup_steps: Annotated[
        int, typer.Option(help="First N steps train only the indexer, against dense attention (O(T^2): short contexts).", rich_help_panel=_IDX)
    ] = 0,
    indexer_recall_every: Annotated[
        int, typer.Option(help="Every N steps log how much dense attention the indexer's selection keeps (0: never).", rich_help_panel=_IDX)
    ] = 0,
    indexer_recall_queries: Annotated[int, typer.Option(help="Sampled queries per DSA layer for the recall.", rich_help_panel=_IDX)] = 256,
    indexer_topk: Annotated[
        int | None,
        typer.Option(help="Keys each DSA query selects in this run (default: the model's; the saved model keeps the new value).", rich_help_panel=_IDX, show_default=False),
    ] = None,
    copy_oracle: Annotated[
        int,
        typer.Option(help="Copy curriculum: put into each query's selection the pool after the last earlier occurrence of its K last bases (K = 12-20; 0: off; docs/longrange.md).", rich_help_panel=_IDX),
    ] = 0,
    layers: Annotated[
        int | None, typer.Option(help="Layers of the --preset model (its one scale dial; default: the preset's).", show_default=False)
    ] = None,
) -> None:
    """Fine-tune (or train from scratch) on a prepared genome at 512k-1M tokens per sequence.

    Examples:

    \b
    genolong finetune --data data/hg38 --seq 512k --preset glm53-mini --out runs/a
    genolong finetune --data data/hg38 --seq 128k --model /ckpt/glm5 --out runs/b
    genolong finetune --resume runs/a [--steps 120]
    genolong finetune ... --out runs/a --overwrite   (start runs/a again)
    torchrun --standalone --nproc_per_node=2 -m genolong finetune --parallel cp=2 --data data/hg38 --seq 1M --out runs/c
    """
    from genolong.train.launch import launch
    from genolong.train.options import MemoryOptions, TrainOptions
    from genolong.train.resume_flags import resume_options
    from genolong.units import parse_length

    # The spellings before 0.2, kept hidden: the same quantities under their new names.
    for old, new in (("gpu_budget", "gpu_budget_gib"), ("host_budget", "host_budget_gib")):
        if ctx.params.get(old) is not None:
            typer.echo(f"genolong: --{old.replace('_', '-')} is deprecated; use --{new.replace('_', '-')}", err=True)
    gpu_budget_gib = gpu_budget_gib if gpu_budget_gib is not None else gpu_budget
    host_budget_gib = host_budget_gib if host_budget_gib is not None else host_budget
    if resume:
        # By name: typer may vendor its own click, with its own ParameterSource enum.
        given = {n for n in ctx.params if getattr(ctx.get_parameter_source(n), "name", "") in ("COMMANDLINE", "ENVIRONMENT")}
        options = resume_options(resume, ctx.params, given)
    else:
        if data is None or out is None:
            raise GenolongError("finetune needs --data DIR and --out RUN_DIR (or --resume RUN_DIR to continue a run)")
        memory = MemoryOptions.from_params(ctx.params, gpu_budget_gib=gpu_budget_gib, host_budget_gib=host_budget_gib)
        options = TrainOptions(
            data=str(Path(data).resolve()) if data else None,  # absolute: a resume from any directory finds it
            out=out,
            seq_len=parse_length(seq, "--seq"),
            preset=None if model else preset,
            # Absolute: eval-positional reads it back as the run's default baseline from any directory.
            model_path=str(Path(model).resolve()) if model else None,
            steps=steps,
            lr=lr,
            warmup=warmup,
            min_lr_ratio=min_lr_ratio,
            weight_decay=weight_decay,
            grad_clip=grad_clip,
            batch=batch,
            grad_accum=grad_accum,
            seed=seed,
            save_every=save_every,
            keep_last=keep_last,
            stop_after=stop_after,
            overfit=overfit,
            max_n_fraction=max_n_fraction,
            planted_repeats=planted_repeats,
            kernels=kernels,
            device=device,
            dtype=dtype,
            overwrite=overwrite,
            launcher=launcher,
            ray_address=ray_address,
            parallel=parallel,
            dist_timeout_s=dist_timeout_s,
            progress=progress,
            compile=compile,
            memory=memory,
            balance_rate=balance_rate,
            aux_loss_coeff=aux_loss_coeff,
            repeat_weight=repeat_weight,
            indexer_loss_coeff=indexer_loss_coeff,
            indexer_warmup_steps=indexer_warmup_steps,
            indexer_recall_every=indexer_recall_every,
            indexer_recall_queries=indexer_recall_queries,
            indexer_topk=indexer_topk,
            copy_oracle=copy_oracle,
            layers=layers,
        )
    from genolong.parallel.mesh import launched_world

    try:
        records = launch(options)
    except KeyboardInterrupt as err:
        # One line and the shell's code for Ctrl-C; the launcher says where the run stands.
        typer.echo(f"genolong: interrupted; {str(err) or 'the run stopped'}", err=True)
        raise typer.Exit(130) from None
    if records and (launched_world() or (0,))[0] == 0:
        last = records[-1]
        typer.echo(f"step {last['step']}/{options.steps}: loss {last['loss']:.4f}; run directory {options.out}")
