"""The PNG: three panels that tell the story without the tables.

1. loss by position (bits/base): baseline and checkpoint at full context (solid) and at control
   context (dashed), 95% bands. If the model uses long context, the full curves fall with
   position while the control curves stay flat.
2. relative change vs the baseline by position: full context vs control, with bands. A full
   curve that goes further below zero than the control at late positions is long-range learning.
3. the same relative change split into non-repeat and repeat (soft-masked) bases.
The title carries the one-line verdict: early vs late change and the long-range part.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, MultipleLocator  # noqa: E402

from genolong.eval.report import LN2, Results, fmt_len  # noqa: E402

COLORS = {"baseline": "#7f7f7f", "checkpoint": "#1f77b4", "control": "#ff7f0e", "nonrepeat": "#2ca02c", "repeat": "#9467bd"}


def _tokens(x: float, _pos=None) -> str:
    if x >= 1024 * 1024:
        return f"{x / (1024 * 1024):.4g}M"
    if x >= 1024:
        return f"{x / 1024:.4g}k"
    return f"{x:g}"


def _tick_step(bucket: int, n_buckets: int) -> int:
    """Ticks on bucket edges, at most ~9 of them, so labels read 64k, 128k, ... not 65536."""
    step = bucket
    while n_buckets * bucket / step > 9:
        step *= 2
    return step


def _pct_text(e: dict) -> str:
    if e["value"] is None:
        return "n/a"
    return f"{100 * e['value']:+.2f}% [{100 * e['lo']:+.2f}, {100 * e['hi']:+.2f}]"


def _line(ax, x, est, scale, color, label, style="-", band=True, marker="o"):
    ax.plot(x, est.value * scale, style, color=color, label=label, marker=marker, markersize=3.5, linewidth=1.6)
    if band:
        ax.fill_between(x, est.lo * scale, est.hi * scale, color=color, alpha=0.18, linewidth=0)


def plot_positional(res: Results, path: Path, *, labels: dict[str, str] | None = None) -> None:
    labels = labels or {"baseline": "baseline", "checkpoint": "checkpoint"}
    edges = res.layout.bucket_edges().astype(np.float64)
    x = (edges[:-1] + edges[1:]) / 2
    has_control = bool(res.layout.control)
    c = fmt_len(res.layout.control) if has_control else ""
    c2 = fmt_len(2 * res.layout.control) if has_control else ""
    marker = "o" if len(x) <= 40 else None

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.4), constrained_layout=True)

    ax = axes[0]
    for m in ("baseline", "checkpoint"):
        _line(ax, x, res.loss[(m, "full", "all")], 1 / LN2, COLORS[m], f"{labels[m]}, full context", marker=marker)
        if has_control:
            _line(ax, x, res.loss[(m, "control", "all")], 1 / LN2, COLORS[m], f"{labels[m]}, control ({c}-{c2} context)", "--", band=False, marker=None)
    ax.set_title("held-out loss by position")
    ax.set_ylabel("loss (bits per base)")

    ax = axes[1]
    ax.axhline(0, color="black", linewidth=0.8)
    _line(ax, x, res.rel[("full", "all")], 100, COLORS["checkpoint"], "full context", marker=marker)
    if has_control:
        _line(ax, x, res.rel[("control", "all")], 100, COLORS["control"], f"control: {c}-{c2} context", "--", marker=marker)
    ax.set_title("change vs baseline (below 0 = better)")
    ax.set_ylabel("relative change in loss (%)")

    ax = axes[2]
    ax.axhline(0, color="black", linewidth=0.8)
    for cls, name in (("nonrepeat", "non-repeat bases"), ("repeat", "repeat (soft-masked) bases")):
        if np.any(res.n_tokens(cls) > 0):
            _line(ax, x, res.rel[("full", cls)], 100, COLORS[cls], f"{name}, full context", marker=marker)
            if has_control:
                _line(ax, x, res.rel[("control", cls)], 100, COLORS[cls], f"{name}, control", ":", band=False, marker=None)
    title = "change vs baseline: repeats vs the rest"
    if not np.any(res.n_tokens("repeat") > 0):
        title += "\n(no soft-masked repeat bases in these windows)"
    ax.set_title(title)
    ax.set_ylabel("relative change in loss (%)")

    for ax in axes:
        ax.set_xlabel("position in window (tokens of context before the base)")
        ax.xaxis.set_major_locator(MultipleLocator(_tick_step(res.layout.bucket, res.layout.n_buckets)))
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
        ax.set_xlim(0, edges[-1])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")

    s = res.summary()
    head = (
        f"{labels['checkpoint']} vs {labels['baseline']}: {s['n_windows']} held-out windows of "
        f"{fmt_len(res.layout.seq)}, buckets of {fmt_len(res.layout.bucket)}, 95% bootstrap bands over windows"
    )
    verdict = (
        f"change: overall {_pct_text(s['overall_rel_change'])}   early ({s['early_bucket']}) {_pct_text(s['early_rel_change'])}"
        f"   late ({s['late_bucket']}) {_pct_text(s['late_rel_change'])}   late - early {_pct_text(s['late_minus_early'])}"
    )
    if has_control:
        verdict += (
            f"\nlate at control context {_pct_text(s['late_rel_change_control'])}   "
            f"long-range part of the late change (full - control) {_pct_text(s['long_range_late'])}"
        )
    fig.suptitle(head + "\n" + verdict, fontsize=11)
    # Through a temporary sibling and a rename, like the tables: never a half-written PNG.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    tmp.replace(path)
