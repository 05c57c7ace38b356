"""Plot benchmarks/copy_indexer_arms.py results: copy loss by distance (left) and the share of copy
queries whose selection holds the key they need (right), one line per arm, the oracle and dense
selections as references and uniform guessing (2 bits, the loss on a random first occurrence) dashed;
on real DNA (`--dna` runs) the first occurrence's own loss, by distance, dotted.

    python benchmarks/plot_copy_arms.py arms.json [more.json ...] --out arms.png [--title TEXT]

Several files (e.g. the same model at top-k 32 and 64) are drawn in one figure, a row each.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {  # (arm, selection) -> label, colour, marker
    ("frozen", "indexer"): ("indexer frozen", "tab:red", "o"),
    ("warmup", "indexer"): ("indexer trained: dense warm-up", "tab:orange", "s"),
    ("warmup+sparse", "indexer"): ("indexer trained: warm-up + sparse KL", "tab:green", "^"),
    ("sparse", "indexer"): ("indexer trained: sparse KL only", "tab:purple", "v"),
    ("frozen", "oracle"): ("oracle selection (needed pool held)", "tab:blue", "x"),
    ("frozen", "dense"): ("every key selected (dense)", "tab:gray", "+"),
}


def lines(rows: list[dict]) -> dict:
    out: dict = {}
    for row in rows:
        key = (row["arm"], row["selection"])
        if key in STYLE:
            out.setdefault(key, []).append(row)
    return {k: sorted(v, key=lambda r: r["distance"]) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default=None)
    args = p.parse_args()
    runs = [json.loads(Path(f).read_text()) for f in args.results]
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for (bits_ax, held_ax), run, name in zip(axes, runs, args.results):
        a = run["args"]
        window = max(2 * a["length"] + a["max_gap"], a.get("window") or 0)
        for key, rows in lines(run["rows"]).items():
            label, colour, marker = STYLE[key]
            d = [r["distance"] for r in rows]
            bits_ax.plot(d, [r["copy_bits"] for r in rows], marker=marker, color=colour, label=label)
            if key[1] == "indexer":
                held_ax.plot(d, [100 * r["needed_key_selected"] for r in rows], marker=marker, color=colour, label=label)
        for ax in (bits_ax, held_ax):
            ax.set_xscale("log")
            ax.set_xlabel("distance back to the source (bases)")
            ax.grid(alpha=0.3)
        bits_ax.axhline(2.0, color="black", ls="--", lw=1, label="uniform (first occurrence of random DNA)")
        first = [r for r in run["rows"] if "first_bits" in r and (r["arm"], r["selection"]) == ("frozen", "indexer")]
        if a.get("dna") and first:  # the same bases at their first occurrence, the frozen model's loss (real DNA's cost)
            first.sort(key=lambda r: r["distance"])
            bits_ax.plot([r["distance"] for r in first], [r["first_bits"] for r in first], color="black", ls=":",
                         label="first occurrence (this real DNA)")
        bits_ax.set_ylabel("copy loss (bits/base, after the first 8)")
        bits_ax.set_ylim(bottom=0)
        held_ax.set_ylabel("needed key selected (% of copy queries)")
        held_ax.set_ylim(0, 100)
        where = "real DNA, " if a.get("dna") else ""
        bits_ax.set_title(f"{Path(name).stem}: {where}{window:,}-token windows, top-k {a.get('topk')}", fontsize=10)
        bits_ax.legend(fontsize=7)
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
