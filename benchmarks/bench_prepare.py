"""Speed and memory of `genolong prepare` on a generated FASTA with hg38's record names and sizes.

    python benchmarks/bench_prepare.py                    # full size: 3.1 Gb, ~3.2 GB file
    python benchmarks/bench_prepare.py --scale 0.1        # 310 Mb, for a quick look

Each measurement runs prepare in a fresh process and reads that process's wall time, CPU time
and peak resident memory (wait4 rusage). MB/s = FASTA file bytes / wall seconds. The file was
just written, so it is read from the page cache (warm): this measures prepare, not the disk.
Other processes on the machine slow the wall time: the table gives the 1-minute load average
after each best run and the throughput per CPU-second (all threads: parse, write, checksum).
Two cases: the default split (chr1,chr2 train; chr22 holdout; other records only counted) and
every record encoded (train = all but chr22), the worst case.
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from genolong.data.synthetic import HG38, hg38_like, write_fasta

ALL_BUT_22 = ",".join(name for name, _ in HG38 if name != "chr22")


def measure(fasta: Path, out: Path, train: str | None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "from genolong.data import prepare; "
        f"prepare({str(fasta)!r}, {str(out)!r}, progress=False, log=lambda m: None"
        + (f", train={train!r}" if train else "")
        + ")"
    )
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"prepare failed with status {status}")
    size = fasta.stat().st_size
    return {
        "load": os.getloadavg()[0],
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "mb_per_s": size / 1e6 / wall,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="record lengths times this (1.0 = hg38 size)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/genolong-bench"))
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the best (least disturbed) is kept")
    parser.add_argument("--keep", action="store_true", help="keep the generated FASTA and outputs")
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    fasta = args.workdir / f"hg38-like-x{args.scale:g}.fa"
    records = hg38_like(args.scale)
    if not fasta.exists():
        t = time.perf_counter()
        write_fasta(fasta, records, seed=0, line_width=60)
        print(f"generated {fasta} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    size = fasta.stat().st_size
    bases = sum(n for _, n in records)
    print(
        f"# {platform.node()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        f"# FASTA: {len(records)} records, {bases:,} bases, {size / 1e6:,.0f} MB, plain, 60-column lines, "
        "warm page cache"
    )
    print("| case | bases encoded | wall s | CPU s | MB/s (wall) | MB per CPU-s | peak RSS MiB | load avg (1 min) |")
    print("|---|---|---|---|---|---|---|---|")
    sizes = dict(records)
    for case, train in [("default split (chr1,chr2 / chr22)", None), ("every record encoded", ALL_BUT_22)]:
        encoded = sum(sizes[n] for n in (train or "chr1,chr2").split(",")) + sizes["chr22"]
        runs = [measure(fasta, args.workdir / "out", train) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["wall_s"])
        print(
            f"| {case} | {encoded:,} | {best['wall_s']:.1f} | {best['cpu_s']:.1f} | {best['mb_per_s']:.0f} | "
            f"{size / 1e6 / best['cpu_s']:.0f} | {max(r['peak_rss_mib'] for r in runs):,.0f} | {best['load']:.1f} |"
        )
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
