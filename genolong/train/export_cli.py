"""`genolong export --run RUN [--step N] --out DIR` (genolong.train.export)."""

from __future__ import annotations

from typing import Annotated

import typer


def export(
    run: Annotated[str, typer.Option(help="A finetune run directory (its --out).", show_default=False)],
    out: Annotated[str, typer.Option(help="New directory for the transformers checkpoint.", show_default=False)],
    step: Annotated[int | None, typer.Option(help="Which checkpoint (default: the latest complete one).", show_default=False)] = None,
) -> None:
    """Write a run's checkpoint (any layout it was saved at) as one transformers glm5_next checkpoint.

    The result loads with `--model DIR`, `eval-positional --checkpoint DIR` and transformers.

    Example: genolong export --run runs/c --out ckpt/c
    """
    from genolong.train.export import export as run_export

    path = run_export(run, out, step)
    typer.echo(f"wrote {path}")
