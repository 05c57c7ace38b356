"""DSA sparse attention, forward + backward, side by side on one GPU: genolong's few-head Triton
kernels against megatron-core's padded TileLang kernel and dense causal SDPA.

    python benchmarks/bench_sparse_attention.py --out runs/sparse                   # < 5 min on a fresh H200

1. Parity (first, at 4096 tokens): every candidate launch config against the fp32 reference at 4,
   16 and 64 heads, through the key-chunked backward: relative error of out, dq, dkv and the max
   abs error of lse.
2. Timing, cells in priority order until the time budget is spent (each cell's cost is estimated
   from the cells before it; what does not fit is listed as skipped). A cell is (length, heads,
   implementation):
   - `triton`: the op as a training step runs it (forward, then the key-chunked backward);
   - `triton-fwd`, `triton-bwd`: its forward alone, its backward alone (out and lse from one forward);
   - `megatron`, `megatron-fwd`: megatron-core's TileLang op (genolong/kernels/sparse_mla/tilelang.py,
     W 2051 padded to 2112, q/kv to 576, heads to 16), with backward / forward alone;
   - `sdpa`: dense causal SDPA with the same heads, 128 wide.
   Default cells: the plan below x `--impls` (+ forward-only cells at 128k x 4 heads); `--cells`
   lists them explicitly.

Selections: the fused indexer's on random inputs (bench_kernels' recipe), kpool 4, 512 pools +
the tail: W = 2051; q, kv, dO random bf16. Times: median of CUDA-event-timed repeats after one
warm-up call (which pays compilation and the Triton kernels' config timing); peak = peak
allocated above what was allocated before (inputs excluded, outputs and transients included).

Useful FLOPs: forward 4*H*W*Dl per query (QK^T and PV), backward 8*H*W*Dl (dP, dQ, and dKV's two
products; the backward's recomputation of QK^T is not counted): 12*H*W*Dl per query in all. SDPA:
6*H*d*T^2 (the causal half of 12*H*d*T^2). Results: <out>/bench.jsonl (one line per cell as
measured) and <out>/table.txt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import SIZES, measure  # noqa: E402

import genolong.kernels as kernels  # noqa: E402
from genolong.kernels.sparse_mla import op as sparse_mla  # noqa: E402
from genolong.model import get_preset, ops  # noqa: E402
from genolong.model.dsa import sparse_attention_reference  # noqa: E402

DEV = "cuda"
LATENT = 512
IMPLS = ("triton", "megatron", "sdpa")
PARTS = ("triton-fwd", "triton-bwd", "megatron-fwd")
# (size, heads) in priority order: 4 heads at 128k first, 512k last.
PLAN = [("128k", 4), ("128k", 16), ("128k", 8), ("64k", 4), ("64k", 8), ("64k", 16), ("64k", 64),
        ("512k", 4), ("128k", 64), ("512k", 8), ("512k", 16)]
TILELANG_BUILD_S = 110  # a TileLang build of megatron's forward + backward for a new head count


def selection(seq: int) -> torch.Tensor:
    ic = get_preset("glm53-mini").dsa.indexer
    fused = ops.implementations("dsa_indexer_topk")["triton_two_pass"]
    with torch.no_grad():
        return fused(torch.randn(1, seq, ic.n_heads, ic.head_dim, device=DEV, dtype=torch.bfloat16),
                     torch.randn(1, seq // ic.kpool, ic.head_dim, device=DEV, dtype=torch.bfloat16),
                     torch.rand(1, seq, ic.n_heads, device=DEV), kpool=ic.kpool, topk_pools=ic.topk_pools,
                     always_select_tail=ic.always_select_tail, softmax_scale=ic.head_dim**-0.5)


def lse_reference(q, kv, idx, scale, rows=256):
    out = []
    for t0 in range(0, q.shape[1], rows):
        i = idx[0, t0 : t0 + rows].long()
        s = torch.einsum("thd,twd->thw", q[0, t0 : t0 + rows].float(), kv[0].float()[i.clamp(min=0)]) * scale
        out.append(s.masked_fill((i < 0)[:, None], float("-inf")).logsumexp(-1))
    return torch.cat(out)


def parity(scale: float, log) -> None:
    """Every candidate launch config against the fp32 reference; this also compiles them all, so
    the timing cells below only time them."""
    seq = 4096
    idx = selection(seq)
    for heads in (4, 16, 64):
        torch.manual_seed(heads)
        q = torch.randn(1, seq, heads, LATENT, device=DEV, dtype=torch.bfloat16)
        kv = torch.randn(1, seq, LATENT, device=DEV, dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        qf, kvf = q.float().requires_grad_(), kv.float().requires_grad_()
        ref = sparse_attention_reference(qf, kvf, idx, scale=scale)
        ref.backward(dout.float())
        lse_ref = lse_reference(q, kv, idx, scale)
        fwd = sparse_mla.candidates("fwd", heads, LATENT)
        bwd = sparse_mla.candidates("bwd_keychunk", heads, LATENT)
        for n in range(max(len(fwd), len(bwd))):
            configs = {"fwd": fwd[min(n, len(fwd) - 1)], "bwd": bwd[min(n, len(bwd) - 1)]}
            a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
            out, lse = sparse_mla.sparse_mla(a, b, idx, scale=scale, return_lse=True, key_chunk=1024, configs=configs)
            out.backward(dout)
            err = {name: ((x.float() - r).norm() / r.norm()).item() for name, x, r in
                   (("out", out, ref), ("dq", a.grad, qf.grad), ("dkv", b.grad, kvf.grad))}
            err["lse_abs"] = (lse[0] - lse_ref).abs().max().item()
            ok = max(err["out"], err["dq"], err["dkv"]) <= 1e-2 and err["lse_abs"] <= 1e-2
            log(dict(kind="parity", heads=heads, seq=seq, ok=ok, fwd=configs["fwd"].label(), bwd=configs["bwd"].label(),
                     **{k: float(f"{v:.3g}") for k, v in err.items()}))
        del qf, kvf, ref


def estimate_s(measured: dict, impl: str, seq: int, heads: int, reps: int) -> float | None:
    """Seconds for a cell from the ms per unit (query; SDPA: query^2) of the same impl measured
    before, at this head count or (scaled up by the head ratio) at fewer heads."""
    unit = seq**2 if impl == "sdpa" else seq
    if (impl, heads) in measured:
        per = measured[(impl, heads)]
    else:
        fewer = [h for i, h in measured if i == impl and h <= heads]
        if not fewer:
            return None
        per = measured[(impl, max(fewer))] * heads / max(fewer)
    return (reps + 1) * per * unit / 1e3


def useful_tflop(impl: str, seq: int, heads: int, width: int, ms: float) -> float:
    flops = 6 * heads * 128 * seq**2 if impl == "sdpa" else 12 * heads * width * LATENT * seq
    return flops / (ms * 1e-3) / 1e12


def make_step(impl: str, seq: int, heads: int, idx: torch.Tensor, scale: float):
    """The callable one repeat of a cell runs (its inputs are made here and die with it)."""
    if impl == "sdpa":
        qs, ks, vs = (torch.randn(1, heads, seq, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dsd = torch.randn(1, heads, seq, 128, device=DEV, dtype=torch.bfloat16)
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(dsd)
    q = torch.randn(1, seq, heads, LATENT, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, seq, LATENT, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, seq, heads, LATENT, device=DEV, dtype=torch.bfloat16)
    if impl == "triton-bwd":
        with torch.no_grad():
            out, lse = sparse_mla._forward(q.detach(), kv.detach(), idx, scale)
        return lambda: sparse_mla._backward(q.detach(), kv.detach(), idx, out, lse, dout, scale, sparse_mla.KEY_CHUNK,
                                            sparse_mla.QUERY_BUDGET_BYTES)
    if impl.startswith("megatron"):
        tilelang = ops.implementations("dsa_sparse_attention")["tilelang_sparse_mla"]
        fn = lambda q, kv, idx: tilelang(q, kv, idx, scale=scale)  # noqa: E731
    else:
        fn = lambda q, kv, idx: sparse_mla.sparse_mla(q, kv, idx, scale=scale)  # noqa: E731
    if impl.endswith("-fwd"):
        def forward_only():
            with torch.no_grad():
                fn(q, kv, idx)
        return forward_only

    def step():
        q.grad = kv.grad = None
        fn(q, kv, idx).backward(dout)
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/sparse"))
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop starting cells after this many seconds")
    ap.add_argument("--impls", default="triton,megatron,sdpa")
    ap.add_argument("--plan", default="", help="size:heads,... instead of the default plan")
    ap.add_argument("--cells", default="", help="size:heads:impl,... in priority order (instead of plan x impls)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--tilelang-cached", default="", help="head counts whose TileLang builds are in the cache (no build time budgeted)")
    args = ap.parse_args()
    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    kernels.load()
    scale = get_preset("glm53-mini").dsa.softmax_scale
    if args.cells:
        cells = [(s, int(h), i) for s, h, i in (c.split(":") for c in args.cells.split(",") if c)]
    else:
        impls = [i for i in args.impls.split(",") if i]
        plan = [(s, int(h)) for s, h in (p.split(":") for p in args.plan.split(",") if p)] or PLAN
        extra = [f"{i}-fwd" for i in ("triton", "megatron") if i in impls] + (["triton-bwd"] if "triton" in impls else [])
        cells = [(s, h, i) for s, h in plan for i in impls + (extra if (s, h) == ("128k", 4) else [])]
    unknown = {i for _, _, i in cells if i not in IMPLS + PARTS}
    if unknown:
        sys.exit(f"unknown implementations {sorted(unknown)}; known: {', '.join(IMPLS + PARTS)}")
    jsonl = (args.out / "bench.jsonl").open("a")
    rows = []

    def log(row):
        rows.append(row)
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()
        print(row, flush=True)
        (args.out / "table.txt").write_text(render(rows))  # kept current, in case the run is stopped

    log(dict(kind="env", device=torch.cuda.get_device_name(), torch=torch.__version__, packages=kernels.available(), scale=scale,
             cells=[f"{s}:{h}:{i}" for s, h, i in cells]))
    if not args.skip_parity:
        parity(scale, log)
    per_unit_ms: dict[tuple[str, int], float] = {}  # (impl, heads) -> ms per query (SDPA: per query^2)
    tilelang_built: set[int] = {int(h) for h in args.tilelang_cached.split(",") if h}
    current = None
    for size, heads, impl in cells:
        seq = SIZES[size]
        left = args.budget_s - (time.time() - t_start)
        reps = 3 if seq >= 262144 else 5
        estimate = estimate_s(per_unit_ms, impl, seq, heads, reps) or 20.0
        if impl.startswith("megatron") and heads not in tilelang_built:
            estimate += TILELANG_BUILD_S
        if estimate > left:
            log(dict(kind="skipped", size=size, heads=heads, impl=impl, reason=f"estimated {estimate:.0f} s > {left:.0f} s left"))
            continue
        if current is None or current[0] != seq:
            current = None
            torch.cuda.empty_cache()
            current = (seq, selection(seq))
        idx = current[1]
        torch.manual_seed(seq + heads)
        step = None
        try:
            step = make_step(impl, seq, heads, idx, scale)
            ms, peak = measure(step, reps)
            per_unit_ms[(impl, heads)] = ms / (seq**2 if impl == "sdpa" else seq)
            if impl.startswith("megatron"):
                tilelang_built.add(heads)
            row = dict(kind="time", size=size, heads=heads, impl=impl, ms=round(ms, 2), peak_gib=round(peak, 2))
            if impl in IMPLS:
                row["useful_tflops"] = round(useful_tflop(impl, seq, heads, idx.shape[-1], ms), 1)
            log(row)
        except Exception as why:  # out of memory or a failing kernel: record it and go on
            log(dict(kind="error", size=size, heads=heads, impl=impl, error=f"{type(why).__name__}: {str(why)[:300]}"))
            if not isinstance(why, torch.cuda.OutOfMemoryError):
                traceback.print_exc()
        finally:
            step = None
            torch.cuda.empty_cache()
    log(dict(kind="configs", chosen=sparse_mla.chosen_configs()))
    print("\n" + render(rows))
    print(f"total {time.time() - t_start:.0f} s")


def render(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["kind"] == "parity":
            lines.append(f"parity {r['heads']:>2} heads, {r['fwd']} {r['bwd']}: out {r['out']:.2e} dq {r['dq']:.2e} dkv {r['dkv']:.2e} "
                         f"lse {r['lse_abs']:.2e}  {'ok' if r['ok'] else 'FAILED (> 1e-2)'}")
    cells = {(r["size"], r["heads"], r["impl"]): r for r in rows if r["kind"] in ("time", "error", "skipped")}
    keys = sorted({(s, h) for s, h, _ in cells}, key=lambda k: (SIZES[k[0]], k[1]))
    present = [i for i in IMPLS + PARTS if any(c[2] == i for c in cells)]

    def show(r):
        if r is None:
            return "-"
        if r["kind"] != "time":
            return r["kind"]
        tf = f" ({r['useful_tflops']:.0f})" if "useful_tflops" in r else ""
        return f"{r['ms']:.1f}{tf} {r['peak_gib']:.1f}"

    lines.append("")
    lines.append("ms (useful TFLOP/s) peak GiB; *-fwd: forward alone; triton-bwd: backward alone")
    lines.append("size | heads | " + " | ".join(present) + " | Triton vs megatron")
    for size, heads in keys:
        got = {i: cells.get((size, heads, i)) for i in present}
        ms = {i: r["ms"] for i, r in got.items() if r and r["kind"] == "time"}
        vs_megatron = f"{ms['megatron'] / ms['triton']:.2f}x" if {"triton", "megatron"} <= ms.keys() else "-"
        lines.append(f"{size} | {heads} | " + " | ".join(show(got[i]) for i in present) + f" | {vs_megatron}")
    skipped = [f"{r['size']}/{r['heads']}/{r['impl']}" for r in rows if r["kind"] == "skipped"]
    if skipped:
        lines.append(f"\nskipped (time budget): {', '.join(skipped)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
