"""`genolong finetune` (this file) and `genolong plan` (genolong.train.plan_cli)."""

from __future__ import annotations

from typing import Any

import typer

from genolong.errors import GenolongError
from genolong.train.flags import FINETUNE, memory_options, with_flags
from genolong.train.plan_cli import plan  # noqa: F401  (mounted by genolong.cli)


@with_flags(FINETUNE)
def finetune(ctx: typer.Context, **params: Any) -> None:
    """Fine-tune (or train from scratch) on a prepared genome at 512k-1M tokens per sequence.

    Examples:

    \b
    genolong finetune --data data/hg38 --seq 512k --preset glm53-mini --out runs/a
    genolong finetune --data data/hg38 --seq 128k --model /ckpt/glm5 --out runs/b
    genolong finetune --resume runs/a [--steps 120]
    genolong finetune ... --out runs/a --overwrite   (start runs/a again)
    torchrun --standalone --nproc_per_node=2 -m genolong finetune --parallel cp=2 --data data/hg38 --seq 1M --out runs/c
    """
    from genolong.train.flags import train_options
    from genolong.train.launch import launch
    from genolong.train.resume_flags import resume_options

    # The spellings before 0.2, kept hidden: the same quantities under their new names.
    for old, new in (("gpu_budget", "gpu_budget_gib"), ("host_budget", "host_budget_gib")):
        if params.get(old) is not None:
            typer.echo(f"genolong: --{old.replace('_', '-')} is deprecated; use --{new.replace('_', '-')}", err=True)
    budgets = {new: params[new] if params[new] is not None else params[old] for old, new in (("gpu_budget", "gpu_budget_gib"), ("host_budget", "host_budget_gib"))}
    if params["resume"]:
        # By name: typer may vendor its own click, with its own ParameterSource enum.
        given = {n for n in ctx.params if getattr(ctx.get_parameter_source(n), "name", "") in ("COMMANDLINE", "ENVIRONMENT")}
        options = resume_options(params["resume"], ctx.params, given)
    else:
        if params["data"] is None or params["out"] is None:
            raise GenolongError("finetune needs --data DIR and --out RUN_DIR (or --resume RUN_DIR to continue a run)")
        options = train_options(params, memory_options(ctx.params, **budgets))
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
