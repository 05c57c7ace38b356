"""eval-recall's numbers and files: per model and distance, bits/base on the copy, on its first
occurrence, on ordinary DNA (null) and on the copy with its source scrambled, three recalls,
per-offset curves; CSV, JSON, PNG, summary.

- bits/base: token-weighted mean loss over offsets [skip, length) of every copy at that
  distance, -log2 p(base) with p renormalised over A, C, G, T (genolong.eval.dnaloss, as
  eval-positional), so 2 bits is uniform guessing for any vocabulary.
- recall = 1 - copy / first: the fraction of the first-occurrence loss that the copy no longer
  costs. 1 = the model predicts the copy perfectly; 0 = it scores the copy like new DNA (it
  does not use the context d bases back); it can be slightly negative by chance.
- recall_null = 1 - copy / null: the copy against ordinary DNA at the same positions. A model
  that recalls by getting worse at ordinary DNA shows it here and not in `recall`.
- recall_scrambled = 1 - copy / scrambled: the copy against itself, at the same positions after
  the same context, with only its earlier occurrence shuffled away: the gain from that
  occurrence alone (0 for a model that does not reach d bases back, whatever it does elsewhere).
- Intervals: 95% percentile bootstrap over windows (genolong.eval.stats), the same draws for
  every model and quantity (paired).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from genolong.eval import stats
from genolong.eval.positional import WindowScore
from genolong.eval.positional import LN2
from genolong.eval.recall_layout import KINDS, LOW_WINDOWS, RecallLayout, RecallResults
from genolong.eval.report import UNITS, Estimate
from genolong.eval.store import write_atomic
from genolong.units import format_length

# Each recall is 1 - copy / (this kind's loss).
RECALLS = {"recall": "first", "recall_null": "null", "recall_scrambled": "scrambled"}
CSV_COLUMNS = ("model", "label", "distance", "n_windows", "n_bases") + tuple(
    f"{q}{suffix}" for q in (*(f"{k}_bits" for k in KINDS), *RECALLS) for suffix in ("", "_lo", "_hi")
)
OFFSET_COLUMNS = ("model", "label", "distance", "offset", "copy_bits", "copy_bits_lo", "copy_bits_hi") + tuple(
    f"{k}_bits" for k in KINDS[1:]
)
OUTPUT_FILES = ("recall.csv", "recall_offsets.csv", "recall.json", "recall.png", "summary.txt")


def aggregate(
    layout: RecallLayout,
    windows: list[tuple[str, int, bool]],
    scores: dict[str, list[WindowScore]],
    labels: dict[str, str],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
) -> RecallResults:
    """scores[role][i] belongs to windows[i]; every model scored the same planted bases."""
    weights = stats.bootstrap_weights(len(windows), n_boot, seed)
    loss, recall, offsets = {}, {}, {}
    n_bases = None
    for role in labels:
        sums = np.stack([s.sums for s in scores[role]])  # [W, D, kind, offset]
        counts = np.stack([s.counts for s in scores[role]]).astype(np.float64)  # [W, D, offset]
        head_s, head_c = sums[..., layout.skip :].sum(-1), counts[..., layout.skip :].sum(-1)
        n_bases = head_c.sum(0) if n_bases is None else n_bases
        for k, kind in enumerate(KINDS):
            loss[(role, kind)] = Estimate(stats.ratio(head_s[:, :, k], head_c), stats.replicate_means(head_s[:, :, k], head_c, weights))
            offsets[(role, kind)] = Estimate(stats.ratio(sums[:, :, k], counts), stats.replicate_means(sums[:, :, k], counts, weights))
        copy = loss[(role, "copy")]
        for name, kind in RECALLS.items():
            against = loss[(role, kind)]
            with np.errstate(invalid="ignore", divide="ignore"):
                recall[(role, name)] = Estimate(1.0 - copy.value / against.value, 1.0 - copy.reps / against.reps)
    return RecallResults(layout, list(windows), dict(labels), np.asarray(n_bases), loss, recall, offsets, dict(meta or {}))


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _fmt(x) -> str:
    return "" if math.isnan(float(x)) else f"{float(x):.6g}"


def _bits(e: Estimate, i) -> list[float]:
    return [e.value[i] / LN2, e.lo[i] / LN2, e.hi[i] / LN2]


def to_csv(res: RecallResults) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for role, label in res.labels.items():
        for i, d in enumerate(res.layout.distances):
            row: list = [role, label, d, len(res.windows), int(res.n_bases[i])]
            for kind in KINDS:
                row += [_fmt(v) for v in _bits(res.loss[(role, kind)], i)]
            for name in RECALLS:
                r = res.recall[(role, name)]
                row += [_fmt(r.value[i]), _fmt(r.lo[i]), _fmt(r.hi[i])]
            writer.writerow(row)
    return buf.getvalue()


def offsets_csv(res: RecallResults) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(OFFSET_COLUMNS)
    for role, label in res.labels.items():
        copy, *others = (res.offsets[(role, k)] for k in KINDS)
        for i, d in enumerate(res.layout.distances):
            for o in range(res.layout.length):
                at = (i, o)
                writer.writerow([role, label, d, o, *(_fmt(v) for v in _bits(copy, at)), *(_fmt(e.value[at] / LN2) for e in others)])
    return buf.getvalue()


def _est(e: Estimate, i, scale: float = 1.0) -> dict[str, float | None]:
    return {"value": _num(e.value[i] * scale), "lo": _num(e.lo[i] * scale), "hi": _num(e.hi[i] * scale)}


def summary(res: RecallResults) -> dict[str, Any]:
    """Per model, the numbers at the longest distance (the headline) and at the shortest."""
    out = {}
    for role, label in res.labels.items():
        entry = {"label": label}
        for name, i in (("shortest", 0), ("longest", len(res.layout.distances) - 1)):
            entry[name] = {
                "distance": res.layout.distances[i],
                **{name: _est(res.recall[(role, name)], i) for name in RECALLS},
                **{f"{k}_bits": _est(res.loss[(role, k)], i, 1 / LN2) for k in KINDS},
            }
        out[role] = entry
    return out


def to_json(res: RecallResults) -> str:
    lay = res.layout
    doc = {
        "units": UNITS,
        "layout": {"seq": lay.seq, "length": lay.length, "distances": list(lay.distances), "skip": lay.skip},
        "windows": [{"record": r, "start": s, "reverse": v} for r, s, v in res.windows],
        "low_window_warning": res.low_windows,
        "n_bases": [int(x) for x in res.n_bases],
        "models": {
            role: {
                "label": label,
                **{
                    f"{k}_bits": [_est(res.loss[(role, k)], i, 1 / LN2) for i in range(len(lay.distances))]
                    for k in KINDS
                },
                **{name: [_est(res.recall[(role, name)], i) for i in range(len(lay.distances))] for name in RECALLS},
                "offset_bits": {
                    k: [[_num(v / LN2) for v in res.offsets[(role, k)].value[i]] for i in range(len(lay.distances))] for k in KINDS
                },
            }
            for role, label in res.labels.items()
        },
        "summary": summary(res),
        "meta": res.meta,
    }
    return json.dumps(doc, indent=1) + "\n"


def _interval(value, lo, hi, fmt: str = "{:.3f}") -> str:
    if math.isnan(float(value)):
        return "n/a"
    return f"{fmt.format(value)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def summary_text(res: RecallResults) -> str:
    lay = res.layout
    lines = [
        f"{len(res.windows)} windows of {format_length(lay.seq)} ({res.meta.get('split', '?')} split), one copy of {lay.length} "
        f"bases per distance per window; bits/base over copy offsets {lay.skip}-{lay.length - 1}; 95% bootstrap intervals over windows",
    ]
    if res.low_windows:
        lines.append(f"warning: fewer than {LOW_WINDOWS} windows: the intervals are rough (percentile intervals run narrow)")
    skipped = res.meta.get("windows_without_room")
    if skipped:
        lines.append(f"{skipped} tiled window(s) had no N-free room for every copy and were skipped")
    unscrambled = res.meta.get("unscrambled_copies")
    if unscrambled:
        lines.append(f"{unscrambled} copy source(s) of a single repeated base could not be scrambled: their control equals the copy")
    lines.append(
        "recall = 1 - copy/first; vs scrambled = 1 - copy/scrambled (the same copy, its source shuffled: the gain from the "
        "earlier occurrence alone); vs null = 1 - copy/null (ordinary DNA at the copy's place)"
    )

    def ratio(role, name, i):
        r = res.recall[(role, name)]
        return _interval(r.value[i], r.lo[i], r.hi[i], "{:+.3f}")

    for role, label in res.labels.items():
        lines.append(f"\n{label} ({role})")
        lines.append(
            f"{'distance':>10} {'copy bits':>24} {'first':>6} {'null':>6} {'scram.':>6} {'recall':>24} {'vs scrambled':>24} {'vs null':>24}"
        )
        copy = res.loss[(role, "copy")]
        for i, d in enumerate(lay.distances):
            lines.append(
                f"{format_length(d):>10} {_interval(copy.value[i] / LN2, copy.lo[i] / LN2, copy.hi[i] / LN2):>24} "
                + " ".join(f"{res.loss[(role, k)].value[i] / LN2:>6.3f}" for k in ("first", "null", "scrambled"))
                + "".join(f" {ratio(role, name, i):>24}" for name in ("recall", "recall_scrambled", "recall_null"))
            )
    longest = format_length(lay.distances[-1])
    parts = [
        f"{label} {ratio(role, 'recall', -1)}, vs scrambled {ratio(role, 'recall_scrambled', -1)}, vs null {ratio(role, 'recall_null', -1)}"
        for role, label in res.labels.items()
    ]
    lines.append(f"\nrecall at the longest distance ({longest}): " + "; ".join(parts))
    timing = res.meta.get("seconds_per_window") or {}
    if any(v is not None for v in timing.values()):
        lines.append("scoring time per window (planted, original and scrambled passes): " + ", ".join(f"{res.labels[r]} {v:.2f} s" for r, v in timing.items() if v is not None))
    return "\n".join(lines) + "\n"


def write_outputs(res: RecallResults, out_dir: Path) -> None:
    from genolong.eval.recall_plot import plot_recall

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "recall.csv", to_csv(res))
    write_atomic(out_dir / "recall_offsets.csv", offsets_csv(res))
    write_atomic(out_dir / "recall.json", to_json(res))
    write_atomic(out_dir / "summary.txt", summary_text(res))
    plot_recall(res, out_dir / "recall.png")
