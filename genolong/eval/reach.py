"""`genolong reach`: how much distant context a genome offers a copier, before any GPU time is spent.

A model uses distant DNA mostly by copying: the k bases before a target occurred earlier, and the
base that followed them there predicts the target. For every window of the held-out split (tiled
as eval-positional tiles it) and every position bucket, this counts the scored targets whose last
k bases last occurred *more than* `beyond` bases earlier in the window (genolong.data.kmers):
bases that a perfect copier predicts from the full window but not from a context truncated to
`beyond` bases, which is what eval-positional's truncated control keeps. Their share in the late
bucket bounds the long-range part of a model's late change: a model that copied them perfectly
(from ~2 bits to 0) would gain about that share of its loss there, and any real model less.
Reported separately for soft-masked (repeat) and other targets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from genolong.data.kmers import MAX_K, previous_occurrence
from genolong.errors import GenolongError
from genolong.units import format_length, parse_length
from genolong.vocab import N_ID


def count_window(tokens: np.ndarray, repeat_mask: np.ndarray, ks: list[int], beyond: int, bucket: int) -> dict:
    """Per k and bucket: scored targets, and those reachable beyond `beyond` (all / repeat / nonrepeat).
    Target j (1..L-1) is in bucket (j // bucket), as eval-positional bins targets."""
    targets = np.asarray(tokens)[1:]
    scored = targets != N_ID
    repeat = np.asarray(repeat_mask, dtype=bool)[1:]
    n_buckets = -(-targets.shape[0] // bucket)
    index = np.arange(1, targets.shape[0] + 1) // bucket

    def per_bucket(mask: np.ndarray) -> list[int]:
        return np.bincount(index[mask], minlength=n_buckets).tolist()

    out = {"scored": per_bucket(scored), "scored_repeat": per_bucket(scored & repeat)}
    for k in ks:
        prev = previous_occurrence(tokens, k)[:-1]  # the k-mer before target j ends at j - 1
        ends = np.arange(prev.shape[0])
        far = scored & (prev >= 0) & (ends - prev > beyond)
        near = scored & (prev >= 0) & (ends - prev <= beyond)
        out[f"k{k}"] = {"far": per_bucket(far), "far_repeat": per_bucket(far & repeat), "near": per_bucket(near)}
    return out


def summarise(rows: list[dict], ks: list[int]) -> dict:
    """Shares (of scored targets) summed over windows, per k and bucket."""
    total = lambda key: np.sum([r[key] for r in rows], axis=0)  # noqa: E731
    scored, scored_rep = total("scored"), total("scored_repeat")
    scored_non = scored - scored_rep
    share = lambda a, b: np.where(b > 0, a / np.maximum(b, 1), np.nan).tolist()  # noqa: E731
    out = {}
    for k in ks:
        far = np.sum([r[f"k{k}"]["far"] for r in rows], axis=0)
        far_rep = np.sum([r[f"k{k}"]["far_repeat"] for r in rows], axis=0)
        near = np.sum([r[f"k{k}"]["near"] for r in rows], axis=0)
        out[str(k)] = {
            "far_share": share(far, scored),
            "far_share_repeat": share(far_rep, scored_rep),
            "far_share_nonrepeat": share(far - far_rep, scored_non),
            "far_in_repeats": share(far_rep, far),
            "near_share": share(near, scored),
        }
    return {"scored": scored.tolist(), "by_k": out}


def reach(
    data: Annotated[Path, typer.Option(help="A `genolong prepare` output directory.")],
    seq: Annotated[str, typer.Option(help="Window length, as eval-positional tiles the split.")] = "512k",
    bucket: Annotated[str, typer.Option(help="Position bucket width.")] = "32k",
    beyond: Annotated[str, typer.Option(help="Count matches more than this far back (eval-positional's --control-context).")] = "32k",
    k: Annotated[str, typer.Option(help="Comma-separated k-mer lengths of an exact match (8-31).")] = "16,20,25",
    split: Annotated[str, typer.Option(help="Split to tile (holdout: what eval-positional scores).")] = "holdout",
    max_windows: Annotated[int | None, typer.Option(help="Count at most this many windows (the first ones).", show_default=False)] = None,
    max_n_fraction: Annotated[float, typer.Option(help="Skip windows with a larger fraction of N bases.")] = 0.1,
    out: Annotated[Path | None, typer.Option(help="Also write reach.json and summary.txt here.", show_default=False)] = None,
) -> None:
    """How much of a genome a perfect copier could predict only from distant context (the ceiling of a long-range gain).

    Examples:
      genolong reach --data data/arenosa --seq 512k --bucket 32k --beyond 32k
      genolong reach --data data/hg38 --seq 1M --k 20 --out eval/hg38-reach
    """
    from genolong.data import open_prepared
    from genolong.data.sampler import tile_windows

    length = parse_length(seq, "--seq")
    width = parse_length(bucket, "--bucket")
    far = parse_length(beyond, "--beyond")
    try:
        ks = sorted({int(x) for x in k.split(",") if x.strip()})
    except ValueError:
        raise GenolongError(f"--k {k!r}: give comma-separated whole numbers, e.g. 16,20,25") from None
    if not ks or not all(8 <= x <= MAX_K for x in ks):
        raise GenolongError(f"--k {k!r}: k-mer lengths must be in 8..{MAX_K} (shorter ones match by chance everywhere)")
    if width > length:
        raise GenolongError(f"--bucket {bucket} is longer than the window --seq {seq}; use a bucket of at most {format_length(length)}")
    if far >= length - 1:
        raise GenolongError(f"--beyond {beyond} leaves no target of a {seq} window that could be reached from farther back; lower it")
    if not Path(data).is_dir():
        raise GenolongError(f"--data {data}: no such directory; run `genolong prepare` first and pass its --out")
    pg = open_prepared(data)
    rows, places = [], []
    for window in tile_windows(pg, split, length, max_windows=max_windows, max_n_fraction=max_n_fraction):
        rows.append(count_window(window.tokens, window.repeat_mask, ks, far, width))
        places.append(f"{window.record}:{window.start}")
    if not rows:
        raise GenolongError(f"no window of {seq} in the {split} split passes --max-n-fraction {max_n_fraction}; use a shorter --seq")
    result = {"seq": length, "bucket": width, "beyond": far, "split": split, "windows": places, **summarise(rows, ks)}
    text = _summary(result, ks)
    typer.echo(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "reach.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        (out / "summary.txt").write_text(text + "\n", encoding="utf-8")


def _summary(result: dict, ks: list[int]) -> str:
    lines = [
        f"{len(result['windows'])} windows of {format_length(result['seq'])} ({result['split']} split); share of scored targets "
        f"whose last k bases last occurred more than {format_length(result['beyond'])} back (a copier's reach beyond the "
        "truncated control), by bucket:",
        "",
        "  k  " + "".join(f"{format_length(i * result['bucket']) if i else '0':>9}" for i in range(len(result["scored"]))),
    ]
    for k in ks:
        row = result["by_k"][str(k)]["far_share"]
        lines.append(f"{k:>3}  " + "".join(f"{100 * v:8.2f}%" for v in row))
    lines.append("")
    for k in ks:
        r = result["by_k"][str(k)]
        lines.append(
            f"k={k}, last bucket: {100 * r['far_share'][-1]:.2f}% of targets reachable only from beyond "
            f"(repeats {100 * r['far_share_repeat'][-1]:.2f}%, other bases {100 * r['far_share_nonrepeat'][-1]:.2f}%; "
            f"{100 * r['far_in_repeats'][-1]:.0f}% of them soft-masked); within {format_length(result['beyond'])}: {100 * r['near_share'][-1]:.2f}%"
        )
    lines.append("A model that copied every reachable base perfectly would lower the late bucket's loss by about that share; any real model by less.")
    return "\n".join(lines)
