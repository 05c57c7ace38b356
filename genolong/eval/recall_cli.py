"""`genolong eval-recall`: does a model recall a planted copy of DNA it saw d bases earlier?"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from genolong.errors import GenolongError
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
    max_n_fraction: Annotated[float, typer.Option(help="Skip windows with a larger fraction of N bases.")] = 0.1,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap replicates (resampling windows) for the 95% intervals.")] = 1000,
    seed: Annotated[int, typer.Option(help="Seed of the copies' placement, of the scrambled sources and of the bootstrap.")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda if available).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="bfloat16 or float32 (default: bfloat16 on CUDA, float32 on CPU).")] = None,
    kernels: Annotated[
        Optional[str], typer.Option(help="Ops policy: fused, auto or reference (default: fused on CUDA, reference on CPU).")
    ] = None,
    loss_chunk: Annotated[
        Optional[str], typer.Option(help="Tokens per loss chunk, e.g. 2k or 4096, as in finetune (default: ~256 MiB of fp32 hidden states).")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Discard partial results in --out from another evaluation.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar over windows (stderr).")] = True,
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
    from genolong.data import open_prepared, tile_windows
    from genolong.eval import models
    from genolong.eval.positional import ModelScorer
    from genolong.eval.recall import RecallSettings, evaluate
    from genolong.eval.recall_layout import RecallLayout
    from genolong.eval import runtime
    from genolong.model import ops
    from genolong.train.memory import apply_memory_optimizations
    from genolong.train.options import MemoryOptions

    seq_len = parse_length(seq, "--seq")
    if str(distances).strip() == "auto":
        picked = RecallLayout.auto_distances(seq_len, length)
    else:
        picked = tuple(sorted(parse_length(d, "--distances") for d in str(distances).split(",") if d.strip()))
    layout = RecallLayout(seq=seq_len, length=length, distances=picked, skip=skip)
    chunk = parse_length(loss_chunk, "--loss-chunk") if loss_chunk is not None else None
    if bootstrap < 1 or windows < 1:
        raise GenolongError(f"--bootstrap and --windows must be at least 1, got {bootstrap} and {windows}")
    if not 0.0 <= max_n_fraction < 1.0:
        raise GenolongError(f"--max-n-fraction must be in [0, 1), got {max_n_fraction}")
    if not data.is_dir():
        raise GenolongError(f"--data {data}: no such directory; pass the --out directory of `genolong prepare`")
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

    dev = runtime.pick_device(device)
    dtype_name, policy = runtime.pick_dtype_and_kernels(dev, dtype, kernels)

    pg = open_prepared(data)
    records = pg.records(split)

    def tiles():
        return tile_windows(pg, split, layout.seq, max_n_fraction=max_n_fraction)

    if next(iter(tiles()), None) is None:
        raise GenolongError(
            f"the {split} split of {data} has no window of {seq} with at most {max_n_fraction:.0%} N "
            f"(records: {', '.join(f'{n} {n_bases:,} bp' for n, n_bases in records)}): use a smaller --seq or a larger --max-n-fraction"
        )

    def make_scorer(role: str) -> ModelScorer:
        model = models.load(resolved[role], runtime.DTYPES[dtype_name], dev)
        # MoE over the sequence in chunks, as in training and eval-positional; no backward here.
        apply_memory_optimizations(model, MemoryOptions(recompute=False, offload=False, moe_chunking=True).validate())
        # Bits over A, C, G, T (the model's probabilities renormalised over the four bases), as eval-positional.
        return ModelScorer(model, models.token_map_array(resolved[role].spec), device=dev, chunk_tokens=chunk)

    settings = RecallSettings(
        layout=layout,
        out_dir=out,
        windows=windows,
        split=split,
        max_n_fraction=max_n_fraction,
        n_boot=bootstrap,
        seed=seed,
        dtype=dtype_name,
        overwrite=overwrite,
        progress=progress,
        meta={"data_path": str(Path(data).resolve())},
    )
    data_identity = {"sha256": pg.manifest.get("source", {}).get("sha256"), split: [list(r) for r in records]}
    with ops.policy(policy):
        evaluate(settings, {role: r.spec for role, r in resolved.items()}, tiles, make_scorer, data_identity=data_identity)
    typer.echo(f"wrote {out}/recall.png, recall.csv, recall.json, summary.txt")
