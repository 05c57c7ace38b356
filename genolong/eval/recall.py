"""Long-range recall on planted repeats: the loss on a copy vs on its first occurrence, by distance.

Windows are the chosen split (holdout by default) tiled as in eval-positional; each window gets
one copy of `length` bases per requested distance d, placed by genolong.data.planted's rules
from (seed, window) alone, so every model sees exactly the same planted windows. A window where
some distance finds no N-free room is skipped (and counted).

Per window, per distance, per offset o in [0, length) of the copy, four losses (nats, the
model's probabilities renormalised over A, C, G, T as in eval-positional):
- copy: the planted window's loss at target dest + o;
- first: the planted window's loss at target source + o (the same bases, first occurrence);
- null: the unplanted window's loss at target dest + o (ordinary DNA at the copy's place);
- scrambled: the planted window with every copy's source shuffled (genolong.data.planted.
  scramble_sources) at target dest + o: the same bases at the same place after the same
  context, less their earlier occurrence, so copy vs scrambled is what the copy gains from
  that occurrence alone.
So a model costs three forward passes per window (planted, original, scrambled). The first `skip` bases
of a copy cannot be predicted by any model (nothing says a copy has started); the headline
numbers average offsets [skip, length), the per-offset curves keep them all.

Per-window sums go to the same resumable partial file as eval-positional's (genolong.eval.store):
an interrupted evaluation reruns only the missing (model, window) pairs. Aggregation and
outputs: genolong.eval.recall_report.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genolong.data.planted import PlantedWindow, plant_window, scramble_sources, window_rng
from genolong.data.sampler import Window
from genolong.errors import GenolongError
from genolong.eval import recall_report
from genolong.eval.positional import ModelScorer, WindowScore
from genolong.eval.recall_layout import KINDS, RecallLayout
from genolong.eval.run import window_progress
from genolong.eval.store import PartialResults
from genolong.units import format_length

# Part of the partial file's fingerprint: a change in what is scored or how the control is built
# must refuse partial results written before it rather than mix them in.
SCORING = "recall: copy, first, null, scrambled (sources shuffled, PCG64 stream 0x5C4A)"


def plant_for_eval(window: Window, layout: RecallLayout, seed: int) -> PlantedWindow | None:
    """The window with one copy per distance, or None if one of them finds no room."""
    planted = plant_window(window, layout.distances, layout.length, window_rng(seed, window))
    return planted if len(planted.copies) == len(layout.distances) else None


def score_planted(scorer: ModelScorer, planted: PlantedWindow, layout: RecallLayout, seed: int = 0) -> WindowScore:
    """sums [distances, KINDS, length] (nats) and counts [distances, length] of one planted window;
    `seed` picks the scrambled control's shuffles."""
    if len(planted.tokens) != layout.seq:
        raise ValueError(f"window has {len(planted.tokens)} tokens, layout expects {layout.seq}")

    def losses(tokens):  # index j-1 = target j
        return scorer.losses(scorer.token_ids(tokens)[None])[0].double().numpy()

    with_copies = losses(planted.tokens)
    original = losses(planted.original)
    scrambled = losses(scramble_sources(planted, seed)[0])
    length = layout.length
    sums = np.zeros((len(layout.distances), len(KINDS), length))
    counts = np.zeros((len(layout.distances), length), dtype=np.int64)
    offsets = np.arange(length)
    for c in planted.copies:
        i = layout.distances.index(c.distance)
        sums[i, 0] = with_copies[c.dest + offsets - 1]
        sums[i, 1] = with_copies[c.source + offsets - 1]
        sums[i, 2] = original[c.dest + offsets - 1]
        sums[i, 3] = scrambled[c.dest + offsets - 1]
        counts[i] = 1  # planting never uses N bases, so every copy base is scored
    return WindowScore(sums=sums, counts=counts)


@dataclass
class RecallSettings:
    layout: RecallLayout
    out_dir: Path
    windows: int = 32
    split: str = "holdout"
    max_n_fraction: float = 0.1
    n_boot: int = 1000
    seed: int = 0
    dtype: str = "float32"
    overwrite: bool = False
    progress: bool = True
    meta: dict[str, Any] = field(default_factory=dict)


def planted_windows(tiles: Iterable[Window], layout: RecallLayout, seed: int, limit: int) -> Iterator[PlantedWindow | None]:
    """Plant each tile in order; yields None for a tile without room, stops after `limit` planted."""
    planted = 0
    for window in tiles:
        p = plant_for_eval(window, layout, seed)
        yield p
        planted += p is not None
        if planted >= limit:
            return


def evaluate(
    settings: RecallSettings,
    specs: dict,
    tiles: Callable[[], Iterable[Window]],
    make_scorer: Callable[[str], ModelScorer],
    *,
    data_identity: dict[str, Any] | None = None,
    echo: Callable[[str], None] = print,
):
    """Score every model (`specs`: role -> genolong.eval.run.ModelSpec, in order) on the planted
    windows, resumably; aggregate and write the outputs. `tiles()` restarts the tiling."""
    from genolong.model import ops

    layout = settings.layout

    def windows() -> Iterator[PlantedWindow]:
        return (p for p in planted_windows(tiles(), layout, settings.seed, settings.windows) if p is not None)

    tried = list(planted_windows(tiles(), layout, settings.seed, settings.windows))
    keys = [(p.record, int(p.start), bool(p.reverse)) for p in tried if p is not None]
    if not keys:
        raise GenolongError(
            f"no window of the {settings.split!r} split had room for copies at every distance "
            f"({', '.join(format_length(d) for d in layout.distances)}) away from N bases: use fewer or shorter "
            "distances, a smaller --max-n-fraction (windows with fewer N), or another --split"
        )
    fingerprint = {
        "kind": "eval-recall",
        "scoring": SCORING,
        "kinds": list(KINDS),
        "seq": layout.seq,
        "length": layout.length,
        "distances": list(layout.distances),
        "split": settings.split,
        "max_n_fraction": settings.max_n_fraction,
        "seed": settings.seed,
        "dtype": settings.dtype,
        "data": data_identity or {},
        # Models by their weights' fingerprint, never by a path: a moved or copied run resumes.
        "models": {
            role: {"architecture": s.architecture, "token_map": s.token_map, "fingerprint": s.identity.get("fingerprint")}
            for role, s in specs.items()
        },
    }
    partial = PartialResults(settings.out_dir, fingerprint, overwrite=settings.overwrite)
    ops.reset_audit()
    with window_progress(settings.progress) as bar:
        for role, spec in specs.items():
            todo = sum(not partial.done(role, k) for k in keys)
            if todo == 0:
                continue
            scorer = make_scorer(role)
            task = bar.add_task(f"{role} ({spec.label})", total=len(keys), completed=len(keys) - todo)
            for planted in windows():
                key = (planted.record, int(planted.start), bool(planted.reverse))
                if partial.done(role, key):
                    continue
                t0 = time.perf_counter()
                score = score_planted(scorer, planted, layout, settings.seed)
                partial.append(role, key, score, seconds=time.perf_counter() - t0)
                bar.advance(task)
            del scorer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    scores = {role: [partial.get(role, k) for k in keys] for role in specs}
    seconds = {role: _mean([partial.seconds.get(role, {}).get(k) for k in keys]) for role in specs}
    meta = {
        **settings.meta,
        "kernels": ops.audit_summary(),
        "models": {role: {"source": s.source, "label": s.label, **s.identity} for role, s in specs.items()},
        "data": data_identity or {},
        "split": settings.split,
        "max_n_fraction": settings.max_n_fraction,
        "dtype": settings.dtype,
        "seed": settings.seed,
        "n_boot": settings.n_boot,
        "windows_without_room": len(tried) - len(keys),
        # Sources of one repeated base: no shuffle changes them, so their control equals the copy.
        "unscrambled_copies": sum(scramble_sources(p, settings.seed)[1] for p in tried if p is not None),
        "seconds_per_window": seconds,
    }
    labels = {role: s.label for role, s in specs.items()}
    res = recall_report.aggregate(layout, keys, scores, labels, n_boot=settings.n_boot, seed=settings.seed, meta=meta)
    recall_report.write_outputs(res, settings.out_dir)
    echo(recall_report.summary_text(res).rstrip("\n"))
    return res


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None
