"""`genolong eval-recall`: does a model recall a planted copy of DNA it saw d bases earlier?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from genolong.errors import GenolongError
from genolong.eval import flags
from genolong.units import parse_length


def eval_recall(
    data: Annotated[Path, typer.Option(help="A `genolong prepare` output directory.")],
    checkpoint: Annotated[
        list[str],
        typer.Option(metavar="MODEL", help="A model to score: a finetune run (RUN, RUN@STEP), a run checkpoint or a model directory. Repeat to compare models."),
    ],
    out: Annotated[Path, typer.Option(help="Output directory: recall.{csv,json,png}, recall_offsets.csv, summary.txt, partial.jsonl.")],
    baseline: Annotated[Optional[str], typer.Option(help="One more model, scored first and labelled baseline (e.g. the untrained model).")] = None,
    seq: Annotated[str, typer.Option(help="Window length (tokens); the split's records are tiled into windows of this length.")] = "64k",
    length: Annotated[int, typer.Option("--len", help="Bases per planted copy.")] = 64,
    distances: Annotated[
        str, typer.Option(help="Comma-separated distances from first occurrence to copy, e.g. 1k,4k,16k,48k; auto = seq/64, seq/16, seq/4, 3/4 seq.")
    ] = "auto",
    skip: Annotated[int, typer.Option(help="Leading copy bases left out of the headline numbers (no model can know a copy has begun).")] = 16,
    windows: Annotated[int, typer.Option(help="Windows to score (the first ones in tiling order that have room for every copy).")] = 32,
    split: Annotated[str, typer.Option(help="Split to tile (holdout: data no model was trained on).")] = "holdout",
    max_n_fraction: flags.MaxNFraction = 0.1,
    bootstrap: flags.Bootstrap = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the copies' placement, of the scrambled sources and of the bootstrap.")] = 0,
    device: flags.Device = None,
    dtype: flags.Dtype = None,
    kernels: flags.Kernels = None,
    loss_chunk: flags.LossChunk = None,
    overwrite: flags.Overwrite = False,
    progress: flags.Progress = True,
) -> None:
    """Long-range recall on planted repeats: loss on a copy of L bases vs on its first occurrence, by distance.

    Tiles the split into windows of --seq, plants in each one copy of --len bases per distance
    (real DNA copied d bases later, away from N), scores every model on the planted window, the
    original window and the planted window with every copy's source shuffled, and reports per
    distance bits/base on the copy, on its first occurrence, on ordinary DNA at the copy's place
    and on the copy with its source scrambled, and the recalls 1 - copy/first, 1 - copy/null and
    1 - copy/scrambled, with 95% bootstrap intervals over windows. Resumable: rerun the same
    command after an interruption. See docs/recall.md.
    """
    from genolong.data import open_prepared
    from genolong.eval import models, runtime
    from genolong.eval.recall import RecallSettings, evaluate
    from genolong.eval.recall_layout import RecallLayout
    from genolong.model import ops

    seq_len = parse_length(seq, "--seq")
    if str(distances).strip() == "auto":
        picked = RecallLayout.auto_distances(seq_len, length)
    else:
        picked = tuple(sorted(parse_length(d, "--distances") for d in str(distances).split(",") if d.strip()))
    layout = RecallLayout(seq=seq_len, length=length, distances=picked, skip=skip)
    chunk = runtime.loss_chunk_tokens(loss_chunk)
    if windows < 1:
        raise GenolongError(f"--windows must be at least 1, got {windows}")
    runtime.check_sampling(bootstrap, max_n_fraction)
    runtime.check_data(data)
    if not checkpoint:
        raise GenolongError("give at least one --checkpoint")

    resolved = {}
    if baseline:
        resolved["baseline"] = models.resolve(baseline, "--baseline")
    for i, text in enumerate(checkpoint):
        resolved["checkpoint" if i == 0 else f"checkpoint_{i + 1}"] = models.resolve(text, "--checkpoint")
    seen: dict[str, int] = {}
    for r in resolved.values():  # two runs both named "run": make their labels tell them apart
        seen[r.spec.label] = seen.get(r.spec.label, 0) + 1
        if seen[r.spec.label] > 1:
            r.spec.label = f"{r.spec.label} #{seen[r.spec.label]}"

    rt = runtime.settle(runtime.pick_device(device), dtype, kernels, chunk)
    pg = open_prepared(data)
    split_windows = runtime.split_windows(pg, data, split, layout.seq, seq, max_n_fraction=max_n_fraction)

    def make_scorer(role: str):
        return models.scorer(resolved[role], rt)

    settings = RecallSettings(
        layout=layout,
        out_dir=out,
        windows=windows,
        split=split,
        max_n_fraction=max_n_fraction,
        n_boot=bootstrap,
        seed=seed,
        dtype=rt.dtype,
        overwrite=overwrite,
        progress=progress,
        meta={"data_path": str(Path(data).resolve())},
    )
    with ops.policy(rt.policy):
        evaluate(settings, {role: r.spec for role, r in resolved.items()}, split_windows.tiles, make_scorer, data_identity=split_windows.identity)
    typer.echo(f"wrote {out}/recall.png, recall.csv, recall.json, summary.txt")
