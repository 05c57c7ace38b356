"""The cost of the multi-process code path with one rank: `train()` as one process (no process group)
vs the same run as rank 0 of a world of 1 (torchrun's variables set: NCCL group, mesh, the loss and
valid-count all-reduces, the fp32-bucketed gradient sync, the max-over-ranks of the metrics).

Correctness first: at the first length both paths' step-1 losses must agree (the same windows, the
same weights; every collective is over one rank) before anything is timed. Then, per length, a few
steps of each path, interleaved; the first step of a length (kernel compilation, pinned-buffer
registration) is not counted. Checkpoint writes are not part of the comparison (they are off here:
only the steps are timed). Target: <= 3% step time at 128k and 512k (docs/parallel.md).

    source .device/activate.sh && python3 benchmarks/bench_parallel_overhead.py --data /tmp/bundled \
        --out $OUT/overhead          # glm53-mini, 512k then 128k, 2 steps per path: ~6 min on one H200

CPU smoke test: python benchmarks/bench_parallel_overhead.py --data DIR --preset tiny --lengths 256 --steps 2 --out /tmp/o
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from genolong.train import loop  # noqa: E402
from genolong.train.options import MemoryOptions, TrainOptions  # noqa: E402
from genolong.units import format_length, parse_length  # noqa: E402

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(path: str, options: TrainOptions) -> list[dict]:
    """`train(options)` as one process ("one-process") or as rank 0 of 1 ("rank-of-1")."""
    if path == "rank-of-1":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    try:
        return loop.train(options)
    finally:
        for key in RANK_ENV:
            os.environ.pop(key, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a `genolong prepare` directory (python3 -m genolong prepare --fasta bundled --out /tmp/bundled)")
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--lengths", default="512k,128k", help="the longest first: it is the headline number")
    p.add_argument("--steps", default="2,2", help="steps per path at each length (the first is not timed)")
    p.add_argument("--budget-s", type=float, default=360.0, help="skip a length that would not finish within this many seconds")
    p.add_argument("--out", required=True, help="directory for overhead.json and the runs' logs")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    steps += [steps[-1]] * (len(lengths) - len(steps))
    # Checkpoints are not timed; writing them would only spend the budget.
    loop._save = lambda *a, **k: None
    start = time.monotonic()
    result: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": [], "not_run": []}
    per_token_s = None  # the last length's step time per token, to predict the next length's
    for i, (n, k) in enumerate(zip(lengths, steps, strict=True)):
        # Per-token time falls with the length (the indexer's quadratic part): an upper bound.
        predicted = None if per_token_s is None else per_token_s * n * k * 2
        if predicted is not None and time.monotonic() - start + predicted > args.budget_s:
            result["not_run"].append(f"{format_length(n)}: time budget (about {predicted:.0f} s needed)")
            continue
        times: dict[str, list[float]] = {}
        first: dict[str, float] = {}
        for path in ("one-process", "rank-of-1"):
            opts = TrainOptions(data=args.data, out=str(out / f"{path}-{format_length(n)}"), seq_len=n, preset=args.preset, steps=k,
                                warmup=1, progress=False, tensorboard=False, memory=MemoryOptions())
            records = run(path, opts)
            (out / f"{path}-{format_length(n)}.json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
            times[path] = [r["step_time_s"] for r in records[1:]]
            first[path] = records[0]["loss"]
            print(f"{path} {format_length(n)}: losses {[round(r['loss'], 5) for r in records]}, step s {[round(r['step_time_s'], 2) for r in records]}", flush=True)
        if i == 0 and abs(first["one-process"] - first["rank-of-1"]) > 1e-3 * abs(first["one-process"]):
            print(f"FAIL: step-1 losses differ: {first}", flush=True)
            result["correct"] = False
            (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
            return 1
        result["correct"] = True
        one, ranked = statistics.median(times["one-process"]), statistics.median(times["rank-of-1"])
        per_token_s = one / n
        result["rows"].append({"seq": format_length(n), "one_process_s": round(one, 3), "rank_of_1_s": round(ranked, 3),
                               "overhead_pct": round(100 * (ranked / one - 1), 2), "timed_steps": len(times["one-process"]),
                               "step1_loss": first})
    (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print("\n| seq | one process (s/step) | rank of a world of 1 (s/step) | overhead |")
    print("|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['seq']} | {row['one_process_s']} | {row['rank_of_1_s']} | {row['overhead_pct']:+.2f}% |")
    for line in result["not_run"]:
        print(f"not run: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
