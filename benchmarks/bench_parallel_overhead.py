"""The cost of the multi-process code path with one rank, per path:

- one-process: `train()` as today's one-GPU run (no process group);
- rank-of-1: the same run as rank 0 of a world of 1 (torchrun's variables set: NCCL group, mesh,
  the loss and valid-count all-reduces, the fp32-bucketed gradient sync, the max-over-ranks of
  the metrics);
- cp-pass: rank-of-1 with the context-parallel pass applied at cp=1 as well (the trainer applies
  it only from cp=2): the whole code path of a cp run, its collectives over one rank.

Correctness first: at the first length every path's step-1 loss must agree with one-process's
(the same windows, the same weights; every collective is over one rank) before anything is
reported. Per length, `--steps` steps of each path, one path after the other; the first step of
a path (kernel compilation, pinned-buffer registration) is not counted. Checkpoint writes are off
(only the steps are timed). Target: <= 3% step time at 128k and 512k (docs/parallel.md).

    source .device/activate.sh && python3 benchmarks/bench_parallel_overhead.py --data /tmp/bundled \
        --lengths 128k --steps 3 --out $OUT/overhead      # glm53-mini, 3 paths: ~3 min on one H200
    ... --lengths 512k --steps 2 --paths one-process,cp-pass  # ~5.5 min (a 512k step is ~61 s, its first ~95 s)
    (estimates from benchmarks/RESULTS.md's step times, kernels compiled (.kcache carried): a 128k
    step ~13 s, a path's first ~30 s)

CPU smoke test: python benchmarks/bench_parallel_overhead.py --data DIR --preset tiny --lengths 256 --steps 2 --out /tmp/o
(on the CPU the run is gloo and the reference ops)
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


PATHS = ("one-process", "rank-of-1", "cp-pass")


def _with_context_pass_at_one(parallelize):
    """`parallelize` that first applies the context-parallel pass at cp=1 (module docstring)."""

    def both(model, options, pmesh=None, **kwargs):
        from genolong.parallel.context import apply_context_parallel

        apply_context_parallel(model, pmesh)
        return parallelize(model, options, pmesh, **kwargs)

    return both


def run(path: str, options: TrainOptions) -> list[dict]:
    """`train(options)` along `path` (one of PATHS; module docstring)."""
    plain = loop.parallelize
    if path != "one-process":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if path == "cp-pass":
        loop.parallelize = _with_context_pass_at_one(plain)
    try:
        return loop.train(options)
    finally:
        loop.parallelize = plain
        for key in RANK_ENV:
            os.environ.pop(key, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a `genolong prepare` directory (python3 -m genolong prepare --fasta bundled --out /tmp/bundled)")
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--lengths", default="128k", help="comma-separated sequence lengths")
    p.add_argument("--steps", default="3", help="steps per path at each length (the first is not timed)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"which of {', '.join(PATHS)} to run (one-process is the baseline and always runs first)")
    p.add_argument("--budget-s", type=float, default=360.0, help="skip a length that would not finish within this many seconds")
    p.add_argument("--out", required=True, help="directory for overhead.json and the runs' logs")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    steps += [steps[-1]] * (len(lengths) - len(steps))
    paths = ["one-process"] + [x for x in args.paths.split(",") if x and x != "one-process"]
    unknown = [x for x in paths if x not in PATHS]
    if unknown or min(steps) < 2:
        p.error(f"--paths from {', '.join(PATHS)} (got {', '.join(unknown)}) and --steps >= 2 (the first step is not timed)" if unknown
                else "--steps must be >= 2 at every length: the first step of a path is not timed")
    # Checkpoints are not timed; writing them would only spend the budget.
    loop._save = lambda *a, **k: None
    start = time.monotonic()
    result: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": [], "not_run": []}
    per_token_s = None  # the last length's step time per token, to predict the next length's
    for i, (n, k) in enumerate(zip(lengths, steps, strict=True)):
        # Per-token time falls with the length (the indexer's quadratic part): an upper bound.
        predicted = None if per_token_s is None else per_token_s * n * k * len(paths)
        if predicted is not None and time.monotonic() - start + predicted > args.budget_s:
            result["not_run"].append(f"{format_length(n)}: time budget (about {predicted:.0f} s needed)")
            continue
        times: dict[str, list[float]] = {}
        first: dict[str, float] = {}
        for path in paths:
            opts = TrainOptions(data=args.data, out=str(out / f"{path}-{format_length(n)}"), seq_len=n, preset=args.preset, steps=k,
                                warmup=1, progress=False, tensorboard=False, memory=MemoryOptions())
            try:
                records = run(path, opts)
            except Exception as err:  # one path failing (a kernel declining the cp-pass's inputs) leaves the others' numbers
                if path == "one-process":
                    raise
                print(f"{path} {format_length(n)} failed: {type(err).__name__}: {err}", flush=True)
                result["not_run"].append(f"{path} {format_length(n)}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                continue
            (out / f"{path}-{format_length(n)}.json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
            times[path] = [r["step_time_s"] for r in records[1:]]
            first[path] = records[0]["loss"]
            print(f"{path} {format_length(n)}: losses {[round(r['loss'], 5) for r in records]}, step s {[round(r['step_time_s'], 2) for r in records]}", flush=True)
            if i == 0 and abs(first["one-process"] - first[path]) > 1e-3 * abs(first["one-process"]):
                print(f"FAIL: step-1 losses differ: {first}", flush=True)
                result["correct"] = False
                (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
                return 1
            one = statistics.median(times["one-process"])
            per_token_s = one / n
            if path != "one-process":
                other = statistics.median(times[path])
                result["rows"].append({"seq": format_length(n), "path": path, "one_process_s": round(one, 3), "path_s": round(other, 3),
                                       "overhead_pct": round(100 * (other / one - 1), 2), "timed_steps": len(times[path]),
                                       "step_times_s": {x: times[x] for x in ("one-process", path)}, "step1_loss": first})
                print(f"{format_length(n)} {path}: {100 * (other / one - 1):+.2f}% vs one-process", flush=True)
            result["correct"] = True
            # After every path: a stage cut short by its time limit keeps what was measured.
            (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print("\n| seq | path | one process (s/step) | path (s/step) | overhead |")
    print("|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['seq']} | {row['path']} | {row['one_process_s']} | {row['path_s']} | {row['overhead_pct']:+.2f}% |")
    for line in result["not_run"]:
        print(f"not run: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
