"""The PNG: the story without the tables, in bits per base.

1. loss by position (bits/base): the yardsticks (uniform = 2 bits, the Markov model per bucket),
   then baseline and checkpoint at full context (solid, 95% bands) and under each control
   (truncated: dashed, triangles; shuffled: dash-dot, crosses; drawn on top and shifted a little
   to either side of the bucket centre, so a control that equals the full curve still shows). If a model uses long context, its full curve falls with
   position while its control curves stay flat.
2. relative change vs the baseline by position: full context (band) vs each control (error bars). A full
   curve that goes further below zero than a control at late positions is long-range learning.
3. only when the windows hold soft-masked repeats: the same change for repeat and non-repeat
   bases (without repeats it would repeat panel 2).
Bands (and the controls' error bars) from fewer than MIN_WINDOWS windows are hatched (dashed)
and the title says why. The title carries
the numbers: bits/base of every model, early vs late change and the long-range part.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, MultipleLocator  # noqa: E402

from genolong.eval.report import MODELS, UNIFORM_BITS, Results, bits, fmt_len, model_names, pct  # noqa: E402

COLORS = {
    "baseline": "#7f7f7f",
    "checkpoint": "#1f77b4",
    "markov": "#8c564b",
    "uniform": "#000000",
    "truncated": "#ff7f0e",
    "shuffled": "#d62728",
    "nonrepeat": "#2ca02c",
    "repeat": "#9467bd",
}
# Line style and marker of each context; controls are drawn above the full-context lines.
STYLES = {"full": ("-", "o", 2), "truncated": ("--", "v", 3), "shuffled": ("-.", "x", 4)}
PANEL_WIDTH = 6.2


def _tokens(x: float, _pos=None) -> str:
    """A position tick: 64k, 1M for whole k / M (k = 1024, as --seq and --bucket are written), else the
    plain number (1,000 not '0.977k'), so ticks of one axis never mix the two units' roundings."""
    if x == int(x) and int(x) % (1024 * 1024) == 0 and x:
        return f"{int(x) // (1024 * 1024)}M"
    if x == int(x) and int(x) % 1024 == 0 and x:
        return f"{int(x) // 1024}k"
    return f"{x:,.0f}" if x == int(x) else f"{x:,g}"


def _tick_step(bucket: int, n_buckets: int) -> int:
    """Ticks on bucket edges, at most ~7 of them, so labels read 64k, 128k, ... not 65536."""
    step = bucket
    while n_buckets * bucket / step > 7:
        step *= 2
    return step


class _Drawer:
    """Full context: a line with a band. Controls: drawn on top, shifted a little to either side
    of the bucket centre with error bars, so a control that equals the full curve stays visible."""

    def __init__(self, x: np.ndarray, bucket: int, few_windows: bool) -> None:
        self.x = x
        self.dodge = {"full": 0.0, "truncated": -0.12 * bucket, "shuffled": 0.12 * bucket}
        self.few = few_windows
        self.marker = len(x) <= 40

    def line(self, ax, est, scale, color, label, context="full", band=True):
        style, marker, z = STYLES[context]
        x = self.x + self.dodge[context]
        full = context == "full"
        ax.plot(
            x, est.value * scale, style, color=color, label=label, marker=marker if self.marker else None,
            markersize=4 if full else 5, linewidth=1.6 if full else 1.2, zorder=z,
        )
        if not band:
            return
        if full:
            # Few windows: the interval is too narrow to trust; hatch it instead of filling it.
            kw = dict(facecolor="none", edgecolor=color, hatch="///", alpha=0.35) if self.few else dict(color=color, alpha=0.15)
            ax.fill_between(x, est.lo * scale, est.hi * scale, linewidth=0, zorder=1, **kw)
        else:
            err = np.abs(np.stack([est.value - est.lo, est.hi - est.value]) * scale)
            bars = ax.errorbar(x, est.value * scale, yerr=err, fmt="none", ecolor=color, elinewidth=1, capsize=2,
                               alpha=0.5 if self.few else 0.8, zorder=z)
            if self.few:
                for line in bars[2]:
                    line.set_linestyle((0, (2, 2)))


def plot_positional(res: Results, path: Path, *, labels: dict[str, str] | None = None) -> None:
    names = {**model_names(res), **(labels or {})}
    edges = res.layout.bucket_edges().astype(np.float64)
    x = (edges[:-1] + edges[1:]) / 2
    controls = res.layout.controls
    has_repeats = bool(np.any(res.n_tokens("repeat") > 0))
    warning = res.interval_warning()
    draw = _Drawer(x, res.layout.bucket, few_windows=warning is not None)

    n_panels = 3 if has_repeats else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(PANEL_WIDTH * n_panels, 6.6), constrained_layout=True)

    ax = axes[0]
    ax.axhline(UNIFORM_BITS, color=COLORS["uniform"], linestyle=":", linewidth=1.2, label="uniform (2 bits)", zorder=1)
    if ("markov", "full", "all") in res.loss:
        ax.step(edges, np.append(res.loss[("markov", "full", "all")].value, np.nan), where="post",
                color=COLORS["markov"], linewidth=1.6, label=names["markov"], zorder=2)
    for m in MODELS:
        draw.line(ax, res.loss[(m, "full", "all")], 1.0, COLORS[m], f"{names[m]}, full context")
        for ctx in controls:
            draw.line(ax, res.loss[(m, ctx, "all")], 1.0, COLORS[m], f"{names[m]}, {ctx}", context=ctx, band=False)
    ax.set_title("held-out loss by position")
    ax.set_ylabel("bits per base (over A, C, G, T)")

    ax = axes[1]
    ax.axhline(0, color="black", linewidth=0.8)
    draw.line(ax, res.rel[("full", "all")], 100, COLORS["checkpoint"], "full context")
    for ctx in controls:
        draw.line(ax, res.rel[(ctx, "all")], 100, COLORS[ctx], f"{ctx} control", context=ctx)
    ax.set_title(f"{names['checkpoint']} vs {names['baseline']}")
    ax.set_ylabel("relative change in loss, % (below 0 = better)")

    if has_repeats:
        ax = axes[2]
        ax.axhline(0, color="black", linewidth=0.8)
        for cls, name in (("nonrepeat", "non-repeat"), ("repeat", "repeat (soft-masked)")):
            draw.line(ax, res.rel[("full", cls)], 100, COLORS[cls], f"{name}, full context")
            for ctx in controls:
                draw.line(ax, res.rel[(ctx, cls)], 100, COLORS[cls], f"{name}, {ctx}", context=ctx, band=False)
        ax.set_title("the change in repeats vs the rest")
        ax.set_ylabel("relative change in loss, % (below 0 = better)")

    for ax in axes:
        ax.set_xlabel("position in window (bases of context)")
        ax.xaxis.set_major_locator(MultipleLocator(_tick_step(res.layout.bucket, res.layout.n_buckets)))
        ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
        ax.set_xlim(0, edges[-1])
        ax.grid(alpha=0.3)
        # Below the axes: a legend inside would hide the very lines it names.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)

    fig.suptitle(_title(res, names, warning), fontsize=10.5, linespacing=1.5)
    # Through a temporary sibling and a rename, like the tables: never a half-written PNG.
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)


def _title(res: Results, names: dict[str, str], warning: str | None) -> str:
    s = res.summary()
    bpb = s["bits_per_base"]
    width = int(PANEL_WIDTH * (3 if np.any(res.n_tokens("repeat") > 0) else 2) * 12)  # ~12 characters per inch at 10.5 pt
    lines = [
        f"{names['checkpoint']} vs {names['baseline']}: {s['n_windows']} held-out windows of {fmt_len(res.layout.seq)} bases, "
        f"buckets of {fmt_len(res.layout.bucket)}, 95% bootstrap bands over windows",
        "bits/base: " + ", ".join(f"{names[m]} {bits(bpb[m])}" for m in res.models),
        f"change: overall {pct(s['overall_rel_change'])}, early ({s['early_bucket']}) {pct(s['early_rel_change'])}, "
        f"late ({s['late_bucket']}) {pct(s['late_rel_change'])}, late - early {pct(s['late_minus_early'])}",
    ]
    if res.layout.controls:
        c, c2 = fmt_len(res.layout.control), fmt_len(2 * res.layout.control)
        parts = [f"full - {ctx} {pct(s[f'long_range_late_{ctx}'])}" for ctx in res.layout.controls]
        lines.append(f"long-range part of the late change (controls keep {c}-{c2} bases of real context): " + ", ".join(parts))
    # An interval is never split across lines: its spaces become non-breaking before wrapping.
    lines = [re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace(" ", "\u00a0"), line) for line in lines]
    wrapped = [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="    ")]
    if warning:
        wrapped += textwrap.wrap(f"WARNING (hatched bands): {warning}", width)
    return "\n".join(wrapped)
