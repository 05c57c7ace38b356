"""`genolong eval-positional`: held-out loss by position in the window, before vs after fine-tuning."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from genolong.errors import GenolongError
from genolong.eval import flags
from genolong.units import parse_length


def eval_positional(
    data: Annotated[Path, typer.Option(help="A `genolong prepare` output directory; its holdout split is scored.")],
    checkpoint: Annotated[
        list[str],  # a list only to refuse a second one in one line (a plain option would silently keep the last)
        typer.Option(help="The fine-tuned model: a finetune run (RUN = its latest checkpoint, RUN@STEP), a run checkpoint or a model directory."),
    ],
    out: Annotated[Path, typer.Option(help="Output directory (positional.csv, .json, .png, summary.txt, partial.jsonl).")],
    baseline: Annotated[
        Optional[str],
        typer.Option(help="The model before fine-tuning (same forms as --checkpoint). Default: the run's step 0, else the model it started from."),
    ] = None,
    seq: Annotated[str, typer.Option(help="Window length (tokens); holdout records are tiled into non-overlapping windows.")] = "512k",
    bucket: Annotated[str, typer.Option(help="Position bucket width; auto = 32k, or a sixteenth of --seq for windows under 512k.")] = "auto",
    control_context: Annotated[
        str,
        typer.Option(
            help="C of the controls: each control target keeps only its last C to 2C-1 bases of real context; "
            "0 = no controls; auto = 32k, or a quarter of --seq for windows under 128k."
        ),
    ] = "auto",
    controls: Annotated[
        str,
        typer.Option(
            help="Controls to run, comma-separated: truncated (the context cut to C-2C bases; ~2x a full pass), "
            "shuffled (the context beyond that dinucleotide-shuffled, same length; ~seq/2C passes), or none."
        ),
    ] = "truncated,shuffled",
    controls_at: Annotated[
        str,
        typer.Option(
            help="Buckets the controls re-score: all, or late (the last bucket only: enough for the long-range part "
            "of the late change, at a fraction of the cost; the shuffled control then costs one full pass, not ~seq/2C)."
        ),
    ] = "all",
    markov_max_order: Annotated[
        int,
        typer.Option(
            help="Highest order of the k-mer Markov baseline fitted on the train split (the order used is "
            "chosen on the validation split; capped by memory and train size)."
        ),
    ] = 12,
    max_windows: Annotated[Optional[int], typer.Option(help="Score at most this many windows (the first ones in order).")] = None,
    max_n_fraction: flags.MaxNFraction = 0.1,
    bootstrap: flags.Bootstrap = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = 0,
    device: flags.Device = None,
    dtype: flags.Dtype = None,
    kernels: flags.Kernels = None,
    loss_chunk: flags.LossChunk = None,
    overwrite: flags.Overwrite = False,
    parallel: Annotated[
        Optional[str],
        typer.Option(help="dp=N,cp=M under torchrun: windows split over dp, each window's tokens over cp (default under torchrun: dp = the number of processes); rank 0 writes the outputs.", show_default=False),
    ] = None,
    progress: flags.Progress = True,
) -> None:
    """Held-out loss by position in the window, before vs after fine-tuning, with context controls.

    Tiles the holdout split into windows of --seq and scores each with the
    baseline and the checkpoint, in bits per base over A, C, G, T (N targets
    are masked). Per --bucket: both losses beside a uniform (2 bits) and a
    k-mer Markov baseline, the change vs the baseline with 95% bootstrap
    intervals over windows, the same under the truncated and shuffled-context
    controls, and repeat vs non-repeat bases. Resumable: rerun the same
    command after an interruption. See docs/eval.md.
    """
    from genolong.data import open_prepared
    from genolong.eval import markov, models, runtime
    from genolong.eval.positional import Layout
    from genolong.eval.run import Settings, evaluate
    from genolong.model import ops

    # The inputs a user names first, before the layout: a missing checkpoint must be reported as
    # such, not as a bucket that does not fit a short --seq.
    runtime.check_data(data)
    if len(checkpoint) != 1:
        raise GenolongError(
            f"--checkpoint given {len(checkpoint)} times ({', '.join(checkpoint)}): eval-positional compares one fine-tuned "
            "model with its --baseline; run it once per model (each into its own --out)"
        )
    checkpoint = checkpoint[0]
    resolved = {"checkpoint": models.resolve(checkpoint, "--checkpoint")}
    resolved["baseline"] = models.resolve(baseline, "--baseline") if baseline else models.default_baseline(checkpoint)

    seq_len = parse_length(seq, "--seq")
    bucket_len = min(32 * 1024, max(1, seq_len // 16)) if str(bucket).strip() == "auto" else parse_length(bucket, "--bucket")
    control_text = str(control_context).strip()
    if control_text == "auto":
        control = min(32 * 1024, seq_len // 4) or None
    else:
        control = None if control_text == "0" else parse_length(control_text, "--control-context")
    wanted = tuple(c.strip() for c in controls.split(",") if c.strip() and c.strip() != "none")
    if not wanted:
        control = None
    layout = Layout(seq=seq_len, bucket=bucket_len, control=control, controls=wanted, controls_at=controls_at.strip())
    chunk = runtime.loss_chunk_tokens(loss_chunk)
    if markov_max_order < 0:
        raise GenolongError(f"--markov-max-order must be 0 or more, got {markov_max_order}")
    runtime.check_sampling(bootstrap, max_n_fraction)
    if max_windows is not None and max_windows < 1:
        raise GenolongError(f"--max-windows must be at least 1, got {max_windows}")

    dev = runtime.pick_device(device)
    share, dev, pmesh = _rank_share(parallel, dev)
    rt = runtime.settle(dev, dtype, kernels, chunk)

    pg = open_prepared(data)
    if "holdout" not in pg.splits or not pg.records("holdout"):
        raise GenolongError(f"--data {data} has no holdout split; re-run genolong prepare with --holdout RECORD")
    holdout = runtime.split_windows(pg, data, "holdout", layout.seq, seq, max_n_fraction=max_n_fraction, max_windows=max_windows)

    def make_scorer(role: str):
        return models.scorer(resolved[role], rt, pmesh)

    settings = Settings(
        layout=layout,
        out_dir=out,
        max_windows=max_windows,
        max_n_fraction=max_n_fraction,
        n_boot=bootstrap,
        seed=seed,
        dtype=rt.dtype,
        overwrite=overwrite,
        progress=progress,
    )

    def note(message: str) -> None:
        typer.echo(message, err=True)

    ops.reset_audit()
    try:
        with ops.policy(rt.policy):
            evaluate(
                settings,
                {role: r.spec for role, r in resolved.items()},
                holdout.tiles,
                make_scorer,
                data_identity=holdout.identity,
                data_path=str(Path(data).resolve()),
                markov=lambda: markov.fit_or_load(pg, out, max_order=markov_max_order, echo=note),
                note=note,
                share=share,
            )
    except KeyboardInterrupt:
        # click would print nothing (or a bare "Aborted!"): say where the scores stand and what to type.
        typer.echo(f"genolong: interrupted; the windows scored so far are kept in {out}: run the same command again to continue", err=True)
        raise typer.Exit(130) from None
    writer = share.main
    if pmesh is not None:
        from genolong.parallel.mesh import leave_together

        # This frame's references to the groups go first, so that leave_together frees them (see there).
        del share, pmesh, make_scorer
        leave_together()
    if writer:
        typer.echo(f"wrote {out}/positional.png, positional.csv, positional.json")


def _rank_share(parallel: str | None, dev):
    """(this process's RankShare, its device, the mesh or None): one process, or one of the
    `--parallel dp=..,cp=..` torchrun ranks."""
    import torch

    from genolong.eval.run import RankShare
    from genolong.parallel.layout import ParallelLayout, parse_layout
    from genolong.parallel.mesh import build_mesh, init_distributed, launched_world

    world = launched_world()
    layout = parse_layout(parallel) if parallel else ParallelLayout(dp=world[1] if world else 1)
    if layout.tp > 1 or layout.ep > 1 or layout.fsdp > 1:
        raise GenolongError(
            f"eval-positional --parallel {layout}: only dp (windows split over processes) and cp (each window split over "
            "processes) are supported; scoring over tp, ep or fsdp ranks is not wired into eval-positional; drop tp, ep and fsdp (use dp)"
        )
    started = world[1] if world else 1
    if layout.world_size != started:
        raise GenolongError(
            f"eval-positional --parallel {layout} needs {layout.world_size} processes but {started} were started; "
            f"start them with `torchrun --standalone --nproc_per_node={layout.world_size} -m genolong eval-positional ...`"
        )
    if world is None:
        return RankShare(), dev, None
    rank, size = init_distributed(dev.type)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    pmesh = build_mesh(layout, dev.type)
    return RankShare(pmesh.rank("dp"), pmesh.size("dp"), group=pmesh.group("dp"), writer=rank == 0), dev, pmesh
