"""From per-window sums to the tables: per-bucket means, relative changes, bootstrap intervals, summary.

Names used throughout (CSV columns, JSON keys, plot labels):
- model: "baseline" or "checkpoint"; context: "full" or "control"; bases: "all", "nonrepeat",
  "repeat" (soft-masked in the FASTA).
- loss_nats: token-weighted mean cross-entropy over the bucket's non-N targets, in nats;
  bits_per_base = loss_nats / ln 2 (one token is one base).
- rel_change: (checkpoint - baseline) / baseline for the same context and bases; negative
  means the checkpoint predicts better.
- *_lo / *_hi: 95% percentile bootstrap interval over windows (paired across models).
- early = the first bucket, late = the last bucket. The late-vs-early gap of rel_change is the
  position dependence of the gain; the long-range part is the late rel_change at full context
  minus the late rel_change at control context (the gain that needs more than 2C of context).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from genolong.eval import stats
from genolong.eval.positional import CLASSES, MODES, Layout, WindowScore
from genolong.units import format_length as _format_length

MODELS = ("baseline", "checkpoint")
BASES = ("all",) + CLASSES
LN2 = math.log(2.0)


def fmt_len(n: int) -> str:
    """Token counts for labels: 0 stays '0' (units.format_length would print '0M')."""
    return "0" if n == 0 else _format_length(n)

CSV_COLUMNS = (
    "model",
    "context",
    "bases",
    "bucket",
    "pos_start",
    "pos_end",
    "n_tokens",
    "loss_nats",
    "loss_nats_lo",
    "loss_nats_hi",
    "bits_per_base",
    "bits_per_base_lo",
    "bits_per_base_hi",
    "rel_change",
    "rel_change_lo",
    "rel_change_hi",
)


@dataclass
class Estimate:
    """A point estimate with its bootstrap replicates (kept to derive further intervals)."""

    value: np.ndarray
    reps: np.ndarray
    lo: np.ndarray = field(init=False)
    hi: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.lo, self.hi = stats.percentile_interval(self.reps)

    def __sub__(self, other: "Estimate") -> "Estimate":
        return Estimate(self.value - other.value, self.reps - other.reps)

    def at(self, index) -> "Estimate":
        return Estimate(np.asarray(self.value[index]), self.reps[:, index])


@dataclass
class Results:
    layout: Layout
    windows: list[tuple[str, int, bool]]
    counts: np.ndarray  # [W, classes, buckets]
    loss: dict[tuple[str, str, str], Estimate]  # (model, context, bases) -> per-bucket nats
    rel: dict[tuple[str, str], Estimate]  # (context, bases) -> per-bucket relative change
    overall: dict[tuple[str, str], Estimate]  # (model, context) -> scalar nats over all targets
    overall_rel: dict[str, Estimate]  # context -> scalar relative change
    meta: dict[str, Any]

    @property
    def contexts(self) -> tuple[str, ...]:
        return MODES if self.layout.control else MODES[:1]

    def n_tokens(self, bases: str) -> np.ndarray:
        per_class = self.counts.sum(axis=0)
        return per_class.sum(axis=0) if bases == "all" else per_class[CLASSES.index(bases)]

    def early_late(self) -> tuple[int, int]:
        """Indices of the first and last buckets that hold targets."""
        filled = np.flatnonzero(self.n_tokens("all") > 0)
        return int(filled[0]), int(filled[-1])

    def summary(self) -> dict[str, Any]:
        early, late = self.early_late()
        full = self.rel[("full", "all")]
        out: dict[str, Any] = {
            "n_windows": len(self.windows),
            "n_tokens": int(self.counts.sum()),
            "early_bucket": _span(self.layout, early),
            "late_bucket": _span(self.layout, late),
            "overall_rel_change": _est(self.overall_rel["full"]),
            "baseline_loss_nats": _est(self.overall[("baseline", "full")]),
            "checkpoint_loss_nats": _est(self.overall[("checkpoint", "full")]),
            "early_rel_change": _est(full.at(early)),
            "late_rel_change": _est(full.at(late)),
            "late_minus_early": _est(full.at(late) - full.at(early)),
        }
        if self.layout.control:
            control = self.rel[("control", "all")]
            out["late_rel_change_control"] = _est(control.at(late))
            out["long_range_late"] = _est(full.at(late) - control.at(late))
        return out


def _span(layout: Layout, b: int) -> str:
    edges = layout.bucket_edges()
    return f"{fmt_len(int(edges[b]))}-{fmt_len(int(edges[b + 1]))}"


def _num(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _est(e: Estimate) -> dict[str, float | None]:
    return {"value": _num(e.value), "lo": _num(e.lo), "hi": _num(e.hi)}


def aggregate(
    layout: Layout,
    windows: list[tuple[str, int, bool]],
    scores: dict[str, list[WindowScore]],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
) -> Results:
    """scores[model][i] belongs to windows[i]; both models must have scored the same targets."""
    counts = np.stack([s.counts for s in scores["baseline"]])
    other = np.stack([s.counts for s in scores["checkpoint"]])
    if not np.array_equal(counts, other):
        raise ValueError("baseline and checkpoint scored different targets")
    sums = {m: np.stack([s.sums for s in scores[m]]) for m in MODELS}  # [W, mode, class, bucket]
    weights = stats.bootstrap_weights(len(windows), n_boot, seed)
    contexts = MODES if layout.control else MODES[:1]

    def estimate(s: np.ndarray, c: np.ndarray) -> Estimate:
        return Estimate(stats.ratio(s, c), stats.replicate_means(s, c, weights))

    loss, overall = {}, {}
    for m in MODELS:
        for ci, ctx in enumerate(contexts):
            per = sums[m][:, ci]
            loss[(m, ctx, "all")] = estimate(per.sum(axis=1), counts.sum(axis=1))
            for k, cls in enumerate(CLASSES):
                loss[(m, ctx, cls)] = estimate(per[:, k], counts[:, k])
            overall[(m, ctx)] = estimate(per.sum(axis=(1, 2)), counts.sum(axis=(1, 2)))

    def rel(b: Estimate, c: Estimate) -> Estimate:
        return Estimate(stats.relative_change(c.value, b.value), stats.relative_change(c.reps, b.reps))

    rels = {
        (ctx, bases): rel(loss[("baseline", ctx, bases)], loss[("checkpoint", ctx, bases)])
        for ctx in contexts
        for bases in BASES
    }
    overall_rel = {ctx: rel(overall[("baseline", ctx)], overall[("checkpoint", ctx)]) for ctx in contexts}
    return Results(layout, list(windows), counts, loss, rels, overall, overall_rel, dict(meta or {}))


def to_csv(res: Results) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    edges = res.layout.bucket_edges()
    for (model, ctx, bases), est in res.loss.items():
        n = res.n_tokens(bases)
        r = res.rel[(ctx, bases)] if model == "checkpoint" else None
        for b in range(res.layout.n_buckets):
            row = [model, ctx, bases, b, int(edges[b]), int(edges[b + 1]), int(n[b])]
            for v in (est.value[b], est.lo[b], est.hi[b]):
                row.append(_fmt(v))
            for v in (est.value[b], est.lo[b], est.hi[b]):
                row.append(_fmt(v / LN2))
            row += [_fmt(v[b]) for v in (r.value, r.lo, r.hi)] if r is not None else ["", "", ""]
            writer.writerow(row)
    return buf.getvalue()


def _fmt(x: float) -> str:
    return "" if math.isnan(float(x)) else f"{float(x):.6g}"


def to_json(res: Results) -> str:
    def arr(a: np.ndarray) -> list[float | None]:
        return [_num(v) for v in np.asarray(a, dtype=np.float64)]

    doc = {
        "meta": res.meta,
        "seq": res.layout.seq,
        "bucket": res.layout.bucket,
        "control_context": res.layout.control,
        "bucket_edges": [int(e) for e in res.layout.bucket_edges()],
        "windows": [{"record": r, "start": s, "reverse": v} for r, s, v in res.windows],
        "n_tokens": {bases: [int(x) for x in res.n_tokens(bases)] for bases in BASES},
        "loss_nats": [
            {"model": m, "context": c, "bases": b, "value": arr(e.value), "lo": arr(e.lo), "hi": arr(e.hi)}
            for (m, c, b), e in res.loss.items()
        ],
        "rel_change": [
            {"context": c, "bases": b, "value": arr(e.value), "lo": arr(e.lo), "hi": arr(e.hi)}
            for (c, b), e in res.rel.items()
        ],
        "summary": res.summary(),
    }
    return json.dumps(doc, indent=1) + "\n"


def _pct(e: dict[str, float | None]) -> str:
    if e["value"] is None:
        return "n/a"
    return f"{100 * e['value']:+.2f}% [{100 * e['lo']:+.2f}, {100 * e['hi']:+.2f}]"


def summary_text(res: Results) -> str:
    s = res.summary()
    base, ck = s["baseline_loss_nats"]["value"], s["checkpoint_loss_nats"]["value"]
    lines = [
        f"{s['n_windows']} windows of {fmt_len(res.layout.seq)}, {s['n_tokens']:,} scored bases, "
        f"buckets of {fmt_len(res.layout.bucket)}; 95% bootstrap intervals over windows",
        f"held-out loss: baseline {base:.4f} -> checkpoint {ck:.4f} nats/base "
        f"({base / LN2:.4f} -> {ck / LN2:.4f} bits/base), change {_pct(s['overall_rel_change'])}",
        f"early ({s['early_bucket']}): {_pct(s['early_rel_change'])}   late ({s['late_bucket']}): "
        f"{_pct(s['late_rel_change'])}   late - early: {_pct(s['late_minus_early'])}",
    ]
    if "long_range_late" in s:
        c = fmt_len(res.layout.control)
        lines.append(
            f"control (context {c}-{fmt_len(2 * res.layout.control)}), late: {_pct(s['late_rel_change_control'])}"
            f"   long-range part of the late gain (full - control): {_pct(s['long_range_late'])}"
        )
    timing = res.meta.get("seconds_per_window") or {}
    if any(v is not None for v in timing.values()):
        parts = [f"{m} {v:.2f} s" for m, v in timing.items() if v is not None]
        lines.append("scoring time per window (full context + control): " + ", ".join(parts))
    return "\n".join(lines) + "\n"
