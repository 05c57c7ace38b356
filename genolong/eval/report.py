"""From per-window sums to the tables: per-bucket means, relative changes, bootstrap intervals, summary.

Names used throughout (CSV columns, JSON keys, plot labels):
- model: "baseline" and "checkpoint" (the two models compared), and the yardsticks "uniform"
  (exactly 2 bits per base) and "markov" (the k-mer Markov model fitted on the train split,
  genolong.eval.markov), scored on exactly the same targets.
- context: "full", or a control: "truncated" (only C to 2C-1 tokens of context) or
  "shuffled" (the context beyond that replaced by a dinucleotide shuffle of itself); the
  yardsticks have full context only (theirs is a few bases).
- bases: "all", "nonrepeat", "repeat" (soft-masked in the FASTA).
- bits_per_base: token-weighted mean of -log2 p(target) over the bucket's non-N targets, with p
  renormalised over A, C, G, T (genolong.eval.dnaloss); one token is one base.
- rel_change: (checkpoint - baseline) / baseline for the same context and bases; negative
  means the checkpoint predicts better.
- *_lo / *_hi: 95% percentile bootstrap interval over windows (paired across models and
  contexts: every estimate uses the same draws of windows).
- early = the first bucket, late = the last bucket. The late-vs-early gap of rel_change is the
  position dependence of the gain; the long-range part is the late rel_change at full context
  minus the late rel_change under a control (the gain that needs more than 2C of real context).
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
REFERENCES = ("uniform", "markov")
BASES = ("all",) + CLASSES
UNIFORM_BITS = 2.0  # -log2(1/4): guessing A, C, G, T at random
# Below this many windows the percentile bootstrap is too narrow to support a claim (docs/eval.md).
MIN_WINDOWS = 20
UNITS = "bits per base: -log2 p(base), p renormalised over A, C, G, T; N targets not scored"


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
    loss: dict[tuple[str, str, str], Estimate]  # (model, context, bases) -> per-bucket bits/base
    rel: dict[tuple[str, str], Estimate]  # (context, bases) -> per-bucket relative change
    overall: dict[tuple[str, str], Estimate]  # (model, context) -> scalar bits/base over all targets
    overall_rel: dict[str, Estimate]  # context -> scalar relative change
    meta: dict[str, Any]

    @property
    def contexts(self) -> tuple[str, ...]:
        return self.layout.contexts

    @property
    def models(self) -> tuple[str, ...]:
        """Every model with rows: the yardsticks first, then baseline and checkpoint."""
        present = {m for m, _, _ in self.loss}
        return tuple(m for m in REFERENCES + MODELS if m in present)

    def n_tokens(self, bases: str) -> np.ndarray:
        per_class = self.counts.sum(axis=0)
        return per_class.sum(axis=0) if bases == "all" else per_class[CLASSES.index(bases)]

    def early_late(self) -> tuple[int, int]:
        """Indices of the first and last buckets that hold targets."""
        filled = np.flatnonzero(self.n_tokens("all") > 0)
        return int(filled[0]), int(filled[-1])

    def interval_warning(self) -> str | None:
        n = len(self.windows)
        if n >= MIN_WINDOWS:
            return None
        return (
            f"only {n} window{'s' if n != 1 else ''}: bootstrap intervals from fewer than {MIN_WINDOWS} windows "
            "are too narrow to support a claim; score more windows (--max-windows, a larger holdout or a shorter --seq)"
        )

    def summary(self) -> dict[str, Any]:
        early, late = self.early_late()
        full = self.rel[("full", "all")]
        out: dict[str, Any] = {
            "units": UNITS,
            "n_windows": len(self.windows),
            "n_tokens": int(self.counts.sum()),
            "interval_warning": self.interval_warning(),
            "early_bucket": _span(self.layout, early),
            "late_bucket": _span(self.layout, late),
            "bits_per_base": {m: _est(self.overall[(m, "full")]) for m in self.models},
        }
        if ("markov", "full") in self.overall:
            markov = self.overall[("markov", "full")]
            out["minus_markov_bits"] = {m: _est(self.overall[(m, "full")] - markov) for m in MODELS}
        out.update(
            {
                "overall_rel_change": _est(self.overall_rel["full"]),
                "early_rel_change": _est(full.at(early)),
                "late_rel_change": _est(full.at(late)),
                # One bucket with targets: early and late are the same, and their difference is no result.
                "late_minus_early": _est(full.at(late) - full.at(early)) if late != early else _NONE,
            }
        )
        for ctx in self.layout.controls:
            control = self.rel[(ctx, "all")]
            out[f"late_rel_change_{ctx}"] = _est(control.at(late))
            out[f"long_range_late_{ctx}"] = _est(full.at(late) - control.at(late))
            out[f"late_{ctx}_minus_full_bits"] = {
                m: _est(self.loss[(m, ctx, "all")].at(late) - self.loss[(m, "full", "all")].at(late)) for m in MODELS
            }
            # The same, split into soft-masked repeats and the other bases: where the distant context helps.
            for cls in CLASSES:
                out[f"long_range_late_{ctx}_{cls}"] = _est(self.rel[("full", cls)].at(late) - self.rel[(ctx, cls)].at(late))
                out[f"late_{ctx}_minus_full_bits_{cls}"] = {
                    m: _est(self.loss[(m, ctx, cls)].at(late) - self.loss[(m, "full", cls)].at(late)) for m in MODELS
                }
        return out


_NONE = {"value": None, "lo": None, "hi": None}


def _span(layout: Layout, b: int) -> str:
    """'64k-96k'; in plain numbers when an edge is not a whole k ('4,000-4,096', not '4000-4k')."""
    lo, hi = (int(e) for e in layout.bucket_edges()[b : b + 2])
    if lo % 1024 or hi % 1024:
        return f"{lo:,}-{hi:,}"
    return f"{fmt_len(lo)}-{fmt_len(hi)}"


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
    """scores[model][i] belongs to windows[i]; every model must have scored the same targets.

    `scores` holds "baseline" and "checkpoint", and optionally "markov" (full context only);
    the "uniform" yardstick is added here (2 bits on every scored target).
    """
    counts = np.stack([s.counts for s in scores["baseline"]])
    for model, rows in scores.items():
        if not np.array_equal(np.stack([s.counts for s in rows]), counts):
            raise ValueError(f"{model} scored different targets than the baseline")
    sums = {m: np.stack([s.sums for s in rows]) for m, rows in scores.items()}  # [W, mode, class, bucket]
    sums["uniform"] = np.full_like(sums["baseline"], np.nan)
    sums["uniform"][:, 0] = UNIFORM_BITS * counts
    weights = stats.bootstrap_weights(len(windows), n_boot, seed)

    def estimate(s: np.ndarray, c: np.ndarray) -> Estimate:
        return Estimate(stats.ratio(s, c), stats.replicate_means(s, c, weights))

    loss, overall = {}, {}
    for m in REFERENCES + MODELS:
        if m not in sums:
            continue
        for ctx in layout.contexts if m in MODELS else ("full",):
            per = sums[m][:, MODES.index(ctx)]
            loss[(m, ctx, "all")] = estimate(per.sum(axis=1), counts.sum(axis=1))
            for k, cls in enumerate(CLASSES):
                loss[(m, ctx, cls)] = estimate(per[:, k], counts[:, k])
            overall[(m, ctx)] = estimate(per.sum(axis=(1, 2)), counts.sum(axis=(1, 2)))

    def rel(b: Estimate, c: Estimate) -> Estimate:
        return Estimate(stats.relative_change(c.value, b.value), stats.relative_change(c.reps, b.reps))

    rels = {
        (ctx, bases): rel(loss[("baseline", ctx, bases)], loss[("checkpoint", ctx, bases)])
        for ctx in layout.contexts
        for bases in BASES
    }
    overall_rel = {ctx: rel(overall[("baseline", ctx)], overall[("checkpoint", ctx)]) for ctx in layout.contexts}
    return Results(layout, list(windows), counts, loss, rels, overall, overall_rel, dict(meta or {}))


def to_csv(res: Results) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    edges = res.layout.bucket_edges()
    for model in res.models:
        for ctx in res.contexts:
            for bases in BASES:
                est = res.loss.get((model, ctx, bases))
                if est is None:
                    continue
                n = res.n_tokens(bases)
                r = res.rel[(ctx, bases)] if model == "checkpoint" else None
                for b in range(res.layout.n_buckets):
                    row = [model, ctx, bases, b, int(edges[b]), int(edges[b + 1]), int(n[b])]
                    row += [_fmt(v[b]) for v in (est.value, est.lo, est.hi)]
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
        "units": UNITS,
        "seq": res.layout.seq,
        "bucket": res.layout.bucket,
        "control_context": res.layout.control,
        "controls": list(res.layout.controls),
        "controls_at": res.layout.controls_at,
        "bucket_edges": [int(e) for e in res.layout.bucket_edges()],
        "windows": [{"record": r, "start": s, "reverse": v} for r, s, v in res.windows],
        "n_tokens": {bases: [int(x) for x in res.n_tokens(bases)] for bases in BASES},
        "bits_per_base": [
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


def _signed(x: float, digits: int) -> str:
    """+1.25 / -0.50 / +0.00: a value that rounds to zero is printed as +0, never as -0."""
    text = f"{x:+.{digits}f}"
    return "+" + text[1:] if float(text) == 0 else text


def pct(e: dict[str, float | None]) -> str:
    """A relative change with its interval, in percent."""
    if e["value"] is None:
        return "n/a"
    return f"{_signed(100 * e['value'], 2)}% [{_signed(100 * e['lo'], 2)}, {_signed(100 * e['hi'], 2)}]"


def bits(e: dict[str, float | None], signed: bool = False) -> str:
    """A bits/base value with its interval (none shown when it has no width, as for uniform)."""
    if e["value"] is None:
        return "n/a"

    def f(x: float) -> str:
        return _signed(x, 4) if signed else f"{x:.4f}"

    if e["lo"] is None or e["lo"] == e["hi"]:
        return f(e["value"])
    return f"{f(e['value'])} [{f(e['lo'])}, {f(e['hi'])}]"


def model_names(res: Results) -> dict[str, str]:
    """Display names: the compared models' labels, the yardsticks with their parameters."""
    labels = {m: (res.meta.get("models", {}).get(m, {}) or {}).get("label") or m for m in MODELS}
    markov = res.meta.get("markov") or {}
    labels["uniform"] = "uniform"
    labels["markov"] = f"Markov order {markov['order']}" if "order" in markov else "Markov"
    return labels


def control_description(res: Results, ctx: str) -> str:
    c, c2 = fmt_len(res.layout.control), fmt_len(2 * res.layout.control)
    if ctx == "truncated":
        return f"truncated control (only the last {c}-{c2} bases of context)"
    return f"shuffled control (context beyond the last {c}-{c2} bases dinucleotide-shuffled)"


def _share(x: float | None) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.2f}%"


def summary_text(res: Results) -> str:
    s = res.summary()
    names = model_names(res)
    bpb = s["bits_per_base"]
    lines = [
        f"{s['n_windows']} windows of {fmt_len(res.layout.seq)}, {s['n_tokens']:,} scored bases, "
        f"buckets of {fmt_len(res.layout.bucket)}; 95% bootstrap intervals over windows",
    ]
    if s["interval_warning"]:
        lines.append(f"WARNING: {s['interval_warning']}")
    if res.layout.controls and res.layout.controls_at == "late":
        lines.append("the controls re-score the last bucket only (--controls-at late): no control curve in the other buckets")
    lines.append("held-out loss in bits/base (probabilities renormalised over A, C, G, T; uniform guessing = 2):")
    lines.append("  " + " | ".join(f"{names[m]} {bits(bpb[m])}" for m in res.models))
    if "minus_markov_bits" in s:
        diffs = ", ".join(f"{names[m]} {bits(s['minus_markov_bits'][m], signed=True)}" for m in MODELS)
        lines.append(f"  minus {names['markov']} (below 0 = better than the Markov model): {diffs}")
    lines.append(
        f"change vs baseline: overall {pct(s['overall_rel_change'])}; early ({s['early_bucket']}) "
        f"{pct(s['early_rel_change'])}; late ({s['late_bucket']}) {pct(s['late_rel_change'])}; "
        f"late - early {pct(s['late_minus_early'])}"
    )
    for ctx in res.layout.controls:
        diffs = ", ".join(f"{names[m]} {bits(s[f'late_{ctx}_minus_full_bits'][m], signed=True)}" for m in MODELS)
        lines += [
            f"{control_description(res, ctx)}: late change {pct(s[f'late_rel_change_{ctx}'])}; "
            f"long-range part of the late change (full - {ctx}) {pct(s[f'long_range_late_{ctx}'])}",
            f"  late bucket, {ctx} minus full context, bits/base (above 0 = the real context helps): {diffs}",
        ]
        for cls in CLASSES:
            per = s[f"late_{ctx}_minus_full_bits_{cls}"]
            diffs = ", ".join(f"{names[m]} {bits(per[m], signed=True)}" for m in MODELS)
            lines.append(
                f"    {'soft-masked repeats' if cls == 'repeat' else 'other bases'}: long-range part "
                f"{pct(s[f'long_range_late_{ctx}_{cls}'])}; {ctx} minus full, bits/base: {diffs}"
            )
    reach = res.meta.get("reach")
    if reach:
        lines.append(
            f"reach (genolong reach, k={reach['k']}): {_share(reach['late_share'])} of the late bucket's targets repeat a "
            f"{reach['k']}-mer last seen more than {fmt_len(reach['beyond'])} back (repeats {_share(reach['late_share_repeat'])}, "
            f"other bases {_share(reach['late_share_nonrepeat'])}): a perfect copier's ceiling for the long-range part"
        )
    markov = res.meta.get("markov") or {}
    if markov:
        lines.append(
            f"Markov model: order {markov['order']} (of 0-{markov['max_order']}), add-{markov['alpha']:g} smoothing, "
            f"fitted on {markov['train_bases']:,} train bases, chosen on {markov['validation']}"
        )
    timing = res.meta.get("seconds_per_window") or {}
    if any(v is not None for v in timing.values()):
        parts = [f"{names.get(m, m)} {v:.2f} s" for m, v in timing.items() if v is not None]
        what = " + ".join(res.contexts)
        lines.append(f"scoring time per window ({what}): " + ", ".join(parts))
    return "\n".join(lines) + "\n"
