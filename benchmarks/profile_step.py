"""Where the GPU time of one training step goes: torch.profiler over one glm53-mini step.

    python benchmarks/profile_step.py --data data/bundled --seq 128k --out runs/profile

Warm-up steps first (kernel compilation, autotuning, pinned-buffer registration), then one
profiled step with the same memory options as `genolong finetune` (full stack by default).
Writes <out>/kernels.txt (CUDA kernels by total time), <out>/categories.json (time per kind of
work: the kernel-name patterns below), <out>/gaps.json (the compute stream's idle gaps and their
causes: trace_gaps.py; "busy" in kernels.txt sums every stream, the offload copies included),
with --sync-census <out>/sync_census.json (one more step's host syncs by call site: sync_census.py),
with --sites-seq <out>/sites.json (after a warm-up step at that length, one more, shorter step's kernels by the genolong line or backward
node that launched them: op_sites.py), and prints them. The MFU target is judged against this.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory_ablation import HOST_RAM_GIB, Bench  # noqa: E402
from op_sites import profile_sites, report as report_sites  # noqa: E402
from sync_census import census, report as census_report  # noqa: E402
from trace_gaps import analyse, report  # noqa: E402

from genolong.train.compile import apply_compile  # noqa: E402
from genolong.train.options import MemoryOptions  # noqa: E402
from genolong.train.passes import compile_pass_on  # noqa: E402
from genolong.units import parse_length  # noqa: E402

# First match wins; names are CUDA kernel names as the profiler reports them.
CATEGORIES = [
    ("sparse attention (Triton sparse MLA or TileLang)", r"sparse_mla|main_kernel|tilelang|sparse_attn|preprocess_kernel|postprocess_kernel"),
    ("indexer pass 1 (Triton)", r"_group_max"),
    ("indexer pass 2 (Triton)", r"_candidate"),
    ("top-k / sort", r"topk|TopK|radix|sort|Sort|gatherTopK|bitonic"),
    ("KDA (fla)", r"chunk_kda|kda|chunk_gla|chunk_|fwd_kernel|bwd_kernel|l2norm|solve_tril|recompute_w_u|gated_delta|_wy_"),
    ("GEMM (cuBLAS/cutlass)", r"gemm|Gemm|sm90_xmma|cutlass|nvjet|wgmma|GroupedMM|grouped"),
    ("host<->device copies", r"Memcpy|memcpy"),
    ("optimizer (foreach/fused)", r"multi_tensor|foreach|adam|Adam"),
    ("reductions / norms", r"reduce|Reduce|norm|Norm|softmax|Softmax|log_softmax|cross_entropy"),
    ("selection bookkeeping (chunk bounds, kept pack / expand)", r"_chunk_bounds|_kept_selection"),
    ("elementwise / other", r"."),
]


def categorize(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "elementwise / other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None)
    ap.add_argument("--preset", default="glm53-mini")
    ap.add_argument("--seq", default="128k")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-recompute", action="store_true", help="profile without full-layer recompute")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="the compile pass (norms, router, dense MLP; mHC stays fused), as finetune's default: on with a GPU")
    ap.add_argument("--sync-census", action="store_true",
                    help="one more step with torch's sync debug mode: every host sync by call site (sync_census.json)")
    ap.add_argument("--keep-moe", action="store_true", help="keep the MoE outputs for the recompute (MemoryOptions.keep_moe)")
    ap.add_argument("--sites-seq", default=None,
                    help="one more step of this length profiled with Python stacks: each kernel by the genolong line "
                         "(or backward node) that launched it (op_sites.py; <out>/sites.json), e.g. 32k")
    ap.add_argument("--out", type=Path, default=Path("runs/profile"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seq = parse_length(args.seq)
    bench = Bench(args.preset, args.data)
    # The profile is of the step `genolong finetune` runs, so the same rule decides the compile pass.
    compiled = compile_pass_on(args.compile, torch.cuda.is_available(), bench.policy)
    if compiled:
        apply_compile(bench.model, mhc=False)
    opts = MemoryOptions(host_budget_gib=0.75 * HOST_RAM_GIB, recompute=not args.no_recompute, keep_moe=args.keep_moe,
                         **({"offload": False} if args.no_recompute else {}))
    bench.use(opts)
    for k in range(args.warmup):
        t = time.perf_counter()
        row = bench.step(bench.window(seq, k))
        print(f"warm-up step {k + 1}: {time.perf_counter() - t:.1f} s, {row['tokens_per_s']:.0f} tok/s, mfu {row['mfu']}", flush=True)
    tokens = bench.window(seq, 7)
    # CUDA activity only, read back from kineto's own trace file: building Python event objects
    # for the ~10^5 kernels of a long step takes minutes.
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        row = bench.step(tokens)
    print(f"profiled step: {row['step_s']:.2f} s, {row['tokens_per_s']:.0f} tok/s, MFU {row['mfu']}", flush=True)
    trace = args.out / "trace.json"
    prof.export_chrome_trace(str(trace))
    per_kernel: dict = defaultdict(lambda: [0.0, 0])
    events = json.loads(trace.read_text()).get("traceEvents", [])
    gaps = analyse(events)
    (args.out / "gaps.json").write_text(json.dumps(gaps, indent=1) + "\n")
    for ev in events:
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cpu_op") and "dur" in ev:
            per_kernel[ev["name"]][0] += ev["dur"] / 1e3
            per_kernel[ev["name"]][1] += 1
    trace.unlink()
    gpu_ms = max(1e-9, sum(v[0] for v in per_kernel.values()))
    cats: dict = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        cats[categorize(name)] += ms
    lines = [f"step {row['step_s'] * 1e3:.0f} ms wall, {gpu_ms:.0f} ms of GPU kernel time ({gpu_ms / (row['step_s'] * 1e3):.0%} busy)",
             f"{'ms':>9} {'calls':>7} {'%':>6}  kernel"]
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:60]:
        lines.append(f"{ms:9.1f} {n:7d} {ms / gpu_ms:6.1%}  {name[:150]}")
    (args.out / "kernels.txt").write_text("\n".join(lines) + "\n")
    summary = {"seq_len": seq, "step": row, "gpu_kernel_ms": gpu_ms,
               "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "recompute": not args.no_recompute, "compile": compiled}
    (args.out / "categories.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines[:45]))
    print(json.dumps(summary["categories_ms"], indent=1))
    print(report(gaps))
    if args.sites_seq:
        # A shorter step: the same operators and call sites, a trace small enough to read with stacks.
        short = parse_length(args.sites_seq)
        # One unprofiled step at that length first: a new length can set off kernel builds and autotuning
        # (the 2026-12-05 H100 run's untouched 64k step: 1.85 s of Triton's timing fills, 76% of its kernels).
        bench.step(bench.window(short, 10))
        rows = profile_sites(lambda: bench.step(bench.window(short, 9)), args.out)
        print(f"\nkernels by launch site, one {args.sites_seq} step (sites.json):")
        print(report_sites(rows))
    if args.sync_census and torch.cuda.is_available():
        syncs = census(lambda: bench.step(bench.window(seq, 8)))
        (args.out / "sync_census.json").write_text(json.dumps(syncs, indent=1) + "\n")
        print(census_report(syncs))


if __name__ == "__main__":
    main()
