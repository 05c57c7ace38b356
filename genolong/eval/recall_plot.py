"""recall.png: three panels, one colour per model.

1. bits/base by distance (log x): the copy (solid, 95% band), the same bases at their first
   occurrence (dashed), ordinary DNA at the copy's place (dotted) and the copy with its source
   scrambled (dash-dot, triangles; band), with the uniform 2 bits. A model that uses context
   d bases back has its solid line far below its dash-dot one at d.
2. recall = 1 - copy / first by distance, with bands: 1 = perfect recall, 0 = none; the
   position-matched recall 1 - copy / scrambled beside it (dash-dot).
3. bits/base along the copy at the longest distance, offset by offset, copy vs first
   occurrence and vs the copy with its source scrambled: an induction-style model drops after the first few bases; the grey line marks
   `skip`, where the headline average starts.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from genolong.eval.positional import LN2  # noqa: E402
from genolong.eval.recall_layout import LOW_WINDOWS, RecallResults  # noqa: E402
from genolong.units import format_length  # noqa: E402


def _colors(n: int) -> list:
    cmap = plt.get_cmap("tab10")
    return [cmap(i % 10) for i in range(n)]


def plot_recall(res: RecallResults, path: Path) -> None:
    lay = res.layout
    d = np.asarray(lay.distances, dtype=np.float64)
    colors = dict(zip(res.labels, _colors(len(res.labels))))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.4), constrained_layout=True)

    ax = axes[0]
    for role, label in res.labels.items():
        c = colors[role]
        copy = res.loss[(role, "copy")]
        ax.plot(d, copy.value / LN2, "-o", color=c, label=f"{label}: copy", markersize=4)
        ax.fill_between(d, copy.lo / LN2, copy.hi / LN2, color=c, alpha=0.18, linewidth=0)
        ax.plot(d, res.loss[(role, "first")].value / LN2, "--s", color=c, label=f"{label}: first occurrence", markersize=3)
        ax.plot(d, res.loss[(role, "null")].value / LN2, ":", color=c, label=f"{label}: ordinary DNA (null)")
        scrambled = res.loss[(role, "scrambled")]
        ax.plot(d, scrambled.value / LN2, "-.^", color=c, label=f"{label}: copy, source scrambled", markersize=4)
        ax.fill_between(d, scrambled.lo / LN2, scrambled.hi / LN2, color=c, alpha=0.08, linewidth=0)
    ax.axhline(2.0, color="grey", linewidth=0.8, label="uniform ACGT (2 bits)")
    ax.set_ylim(bottom=0)
    ax.set_title("loss on the planted copy by distance")
    ax.set_ylabel("bits per base")

    ax = axes[1]
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(1, color="black", linewidth=0.5, linestyle=":")
    for role, label in res.labels.items():
        r = res.recall[(role, "recall")]
        ax.plot(d, r.value, "-o", color=colors[role], label=f"{label}: vs first occurrence", markersize=4)
        ax.fill_between(d, r.lo, r.hi, color=colors[role], alpha=0.18, linewidth=0)
        ax.plot(d, res.recall[(role, "recall_scrambled")].value, "-.^", color=colors[role], label=f"{label}: vs source scrambled", markersize=4)
    shown = [res.recall[(r, name)].lo for r in res.labels for name in ("recall", "recall_scrambled")]
    lowest = min([float(np.nanmin(lo)) for lo in shown if np.isfinite(lo).any()] or [0.0])
    ax.set_ylim(min(-0.1, lowest - 0.05), 1.05)
    ax.set_title("recall = 1 - copy / first occurrence (or / source scrambled)")
    ax.set_ylabel("share of the first-occurrence loss removed")

    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xticks(d)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: format_length(int(round(x)))))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("distance from first occurrence to copy (bases)")

    ax = axes[2]
    offsets = np.arange(lay.length)
    for role, label in res.labels.items():
        copy = res.offsets[(role, "copy")]
        ax.plot(offsets, copy.value[-1] / LN2, "-", color=colors[role], label=f"{label}: copy")
        ax.fill_between(offsets, copy.lo[-1] / LN2, copy.hi[-1] / LN2, color=colors[role], alpha=0.15, linewidth=0)
        ax.plot(offsets, res.offsets[(role, "first")].value[-1] / LN2, "--", color=colors[role], label=f"{label}: first occurrence")
        ax.plot(offsets, res.offsets[(role, "scrambled")].value[-1] / LN2, "-.", color=colors[role], label=f"{label}: source scrambled")
    ax.axvline(lay.skip, color="grey", linewidth=0.8)
    ax.set_ylim(bottom=0)
    ax.set_title(f"along the copy at the longest distance ({format_length(lay.distances[-1])})")
    ax.set_xlabel("offset in the copy (bases)")
    ax.set_ylabel("bits per base")

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")

    head = (
        f"planted-repeat recall: {len(res.windows)} windows of {format_length(lay.seq)}, copies of {lay.length} bases "
        f"(offsets {lay.skip}+ averaged), 95% bootstrap bands over windows"
    )
    if res.low_windows:
        head += f"\nfewer than {LOW_WINDOWS} windows: bands are rough"
    fig.suptitle(head, fontsize=11)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    tmp.replace(path)
