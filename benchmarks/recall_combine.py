"""One table and figure from several eval-recall outputs of the same planted windows (e.g. the
two arms of benchmarks/recall_gpu.py, each evaluated in its own device call).

    python benchmarks/recall_combine.py A/eval/recall.json B/eval/recall.json --out DIR

Refuses inputs whose layout (window, copy length, distances, skip) or windows differ: only
then are the planted copies the same bases. A model that appears in several inputs under the
same label (the shared initial model) is kept once. Writes DIR/recall_combined.{csv,png}.
Intervals are each input's own bootstrap intervals (arms evaluated separately are not paired).
"""

import argparse
import csv
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", help="recall.json files")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    docs = [json.loads(Path(x).read_text()) for x in args.inputs]
    for x, doc in zip(args.inputs[1:], docs[1:]):
        if doc["layout"] != docs[0]["layout"] or doc["windows"] != docs[0]["windows"]:
            print(f"error: {x} scored other planted windows than {args.inputs[0]} (layout or windows differ)", file=sys.stderr)
            return 2
    models = {}
    for doc in docs:
        for m in doc["models"].values():
            models.setdefault(m["label"], m)
    distances = docs[0]["layout"]["distances"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "recall_combined.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "distance", "copy_bits", "copy_bits_lo", "copy_bits_hi", "first_bits", "null_bits", "recall", "recall_lo", "recall_hi"])
        for label, m in models.items():
            for i, d in enumerate(distances):
                c, r = m["copy_bits"][i], m["recall"][i]
                w.writerow([label, d, c["value"], c["lo"], c["hi"], m["first_bits"][i]["value"], m["null_bits"][i]["value"], r["value"], r["lo"], r["hi"]])

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    colors = plt.get_cmap("tab10")
    for k, (label, m) in enumerate(models.items()):
        c = colors(k % 10)
        val = [x["value"] for x in m["copy_bits"]]
        err = [[v - x["lo"] for v, x in zip(val, m["copy_bits"])], [x["hi"] - v for v, x in zip(val, m["copy_bits"])]]
        axes[0].errorbar(distances, val, yerr=err, fmt="-o", color=c, label=f"{label}: copy", markersize=4, capsize=2)
        axes[0].plot(distances, [x["value"] for x in m["first_bits"]], "--", color=c, label=f"{label}: first occurrence")
        rv = [x["value"] for x in m["recall"]]
        rerr = [[v - x["lo"] for v, x in zip(rv, m["recall"])], [x["hi"] - v for v, x in zip(rv, m["recall"])]]
        axes[1].errorbar(distances, rv, yerr=rerr, fmt="-o", color=c, label=label, markersize=4, capsize=2)
    axes[0].axhline(2.0, color="black", linewidth=0.8, linestyle="-.", label="uniform ACGT")
    axes[0].set_ylabel("bits per base")
    axes[0].set_title("loss on the planted copy vs its first occurrence")
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[1].set_ylabel("recall = 1 - copy / first")
    axes[1].set_title("recall by distance")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("distance (bases)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    lay = docs[0]["layout"]
    fig.suptitle(f"{len(docs[0]['windows'])} windows of {lay['seq']:,} bases, copies of {lay['length']} (offsets {lay['skip']}+), 95% bootstrap intervals")
    fig.savefig(out / "recall_combined.png", dpi=120)
    print(f"wrote {out}/recall_combined.csv, recall_combined.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
