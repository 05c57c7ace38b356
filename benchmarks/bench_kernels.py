"""Per-layer time and peak memory of genolong's hot ops on one GPU, glm53-mini shapes, bf16.

    python benchmarks/bench_kernels.py --out runs/bench            # 16k..512k, + indexer at 1M

First a parity check of each fused op against its reference at a small size, then, for every
length: the KDA layer, the DSA layer (indexer + sparse attention, with its parts separately),
the DSA layer with a dense-attention fallback and dense causal SDPA (where they fit), the MoE
block, and the indexer: fused two-pass vs the plain query-chunked PyTorch version the issue
measured (einsum + relu + weighted head sum + causal mask + topk, 8k queries per chunk).
Layers run forward + backward (the indexer forward only: it is frozen). Times are medians of
CUDA-event-timed repeats after a warm-up; "peak" is the peak allocated memory above what was
allocated before the call (inputs and weights excluded, outputs and saved activations included).
Each result is appended to <out>/bench.jsonl as it is measured; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import genolong.kernels as kernels
from genolong.kernels.indexer import topk as indexer_topk
from genolong.kernels.indexer import triton_kernels as indexer_triton
from genolong.model import get_preset, ops
from genolong.model.dsa import DSAAttention
from genolong.model.kda import KimiDeltaAttention
from genolong.model.moe import MoE

DEV = "cuda"
GIB = 1 << 30
SIZES = {"16k": 16384, "64k": 65536, "128k": 131072, "256k": 262144, "512k": 524288, "1M": 1048576}


def measure(fn, reps: int, warmup: int = 1) -> tuple[float, float]:
    """(median ms, peak GiB above the memory allocated before the first call)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / GIB


def init_(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
    return module.to(DEV, torch.bfloat16)


def fwd_bwd(module, x, pick=lambda out: out):
    def run():
        x.grad = None
        out = pick(module(x))
        out.backward(torch.ones_like(out))
    return run


def baseline_indexer(q, keys, w, *, kpool, topk_pools, scale, chunk=8192):
    """The original work's plain version: einsum over all heads + relu + weighted sum + mask + topk."""
    seq = q.shape[1]
    out = []
    for t0 in range(0, seq, chunk):
        t = torch.arange(t0, min(seq, t0 + chunk), device=q.device)
        s = torch.einsum("bthd,bpd->bthp", q[:, t0 : t0 + chunk], keys).float()
        s = (torch.relu(s * scale) * w[:, t0 : t0 + chunk, :, None]).sum(2)
        visible = (torch.arange(keys.shape[1], device=q.device)[None, :] + 1) * kpool <= t[:, None] + 1
        s = s.masked_fill(~visible, float("-inf"))
        out.append(s.topk(min(topk_pools, keys.shape[1]), dim=-1).indices)
    return out


def dense_attention(q, kv, indices, *, scale):
    """The fallback the seed run hit: dense causal attention on the absorbed latent, scores materialised."""
    s = torch.einsum("bthl,bsl->bhts", q, kv).float() * scale
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    p = s.masked_fill(~causal, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("bhts,bsl->bthl", p, kv)


class Bench:
    def __init__(self, out: Path, only: str = ""):
        self.rows = []
        self.log = (out / "bench.jsonl").open("a")
        self.only = [w for w in only.split(",") if w]

    def record(self, size, case, fn, reps, note=""):
        if self.only and not any(w in case for w in self.only):
            return None
        try:
            ms, peak = measure(fn, reps)
            row = dict(size=size, case=case, ms=round(ms, 2), peak_gib=round(peak, 2), note=note)
        except Exception as why:  # out of memory, or a kernel that failed: record and go on
            row = dict(size=size, case=case, ms=None, peak_gib=None, note=f"{type(why).__name__}: {str(why)[:200]}")
            if not isinstance(why, torch.cuda.OutOfMemoryError):
                traceback.print_exc()
        torch.cuda.empty_cache()
        self.rows.append(row)
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()
        print(row, flush=True)
        return row


def parity(cfg) -> list[str]:
    """Relative errors of fused vs reference for a DSA layer and a MoE block at 8k tokens."""
    lines = []
    torch.manual_seed(0)
    for name, module, pick in (
        ("dsa layer", DSAAttention(cfg.hidden, cfg.dsa, cfg.rms_eps, 3, has_indexer=True), lambda o: o[0]),
        ("moe block", MoE(cfg.hidden, cfg.moe, 3), lambda o: o),
        ("kda layer", KimiDeltaAttention(cfg.hidden, cfg.kda, cfg.rms_eps, 0), lambda o: o),
    ):
        init_(module)
        x = torch.randn(1, 8192, cfg.hidden, device=DEV, dtype=torch.bfloat16)
        results = {}
        for policy in ("reference", "fused"):
            with ops.policy(policy):
                ops.reset_audit()
                xi = x.clone().requires_grad_()
                out = pick(module(xi))
                out.float().pow(2).mean().backward()
                results[policy] = [out.detach().float(), xi.grad.float()] + [p.grad.float().clone() for p in module.parameters() if p.grad is not None]
                module.zero_grad(set_to_none=True)
                ran = sorted(set(ops.audit().values()))
        errs = [((a - b).norm() / b.norm().clamp(min=1e-30)).item() for a, b in zip(results["fused"], results["reference"])]
        lines.append(f"parity {name}: fused={ran} rel err out {errs[0]:.2e}, dx {errs[1]:.2e}, max param grad {max(errs[2:], default=0):.2e}")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/bench"))
    ap.add_argument("--sizes", default="16k,64k,128k,256k,512k")
    ap.add_argument("--indexer-extra", default="1M", help="lengths at which only the fused indexer runs")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--no-indexer", action="store_true", help="skip the indexer cases (benchmarks/bench_indexer.py has them)")
    ap.add_argument("--only", default="", help="comma-separated words: run only the cases whose name contains one")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    kernels.load()
    cfg = get_preset("glm53-mini")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {kernels.available()}", flush=True)
    notes = [] if args.skip_parity else parity(cfg)
    bench = Bench(args.out, args.only)
    ic = cfg.dsa.indexer
    dsa_layer = init_(DSAAttention(cfg.hidden, cfg.dsa, cfg.rms_eps, 3, has_indexer=True))
    kda_layer = init_(KimiDeltaAttention(cfg.hidden, cfg.kda, cfg.rms_eps, 0))
    moe_block = init_(MoE(cfg.hidden, cfg.moe, 3))
    with torch.no_grad():  # uneven routing, like real data: low-numbered experts are favoured
        moe_block.gate.e_score_correction_bias.copy_(torch.linspace(0.05, 0.0, cfg.moe.num_experts))
    ops.use("fused")
    sizes = [s for s in args.sizes.split(",") if s] + [s for s in args.indexer_extra.split(",") if s]
    for size in sizes:
        seq = SIZES[size]
        only_indexer = size not in args.sizes.split(",")
        reps = 3 if seq >= 262144 else 5
        torch.manual_seed(seq)
        q = (torch.randn(1, seq, ic.n_heads, ic.head_dim, device=DEV) * 0.3 + 0.2).bfloat16()
        keys = (torch.randn(1, seq // ic.kpool, ic.head_dim, device=DEV) * 0.3 + 0.2).bfloat16()
        w = torch.randn(1, seq, ic.n_heads, device=DEV) * ic.n_heads**-0.5
        kw = dict(kpool=ic.kpool, topk_pools=ic.topk_pools, always_select_tail=ic.always_select_tail, softmax_scale=ic.head_dim**-0.5)
        fused = ops.implementations("dsa_indexer_topk")["triton_two_pass"]
        if not args.no_indexer:
            bench.record(size, "indexer fused (two-pass, G=8)", lambda: fused(q, keys, w, **kw), reps)
        if seq >= 262144 and not only_indexer and not args.no_indexer:
            bench.record(size, "indexer fused (two-pass, G=4)",
                         lambda: indexer_topk.indexer_two_pass(q, keys, w, group=4, group_max=indexer_triton.group_max,
                                                               candidate_scores=indexer_triton.candidate_scores, **kw), reps)
        # The indexer's time by stage: benchmarks/bench_indexer.py.
        if not only_indexer and not args.no_indexer:
            bench.record(size, "indexer plain chunked PyTorch (8k queries)",
                         lambda: baseline_indexer(q, keys, w, kpool=ic.kpool, topk_pools=ic.topk_pools, scale=ic.head_dim**-0.5),
                         2 if seq >= 262144 else reps)
        del q, keys, w
        if only_indexer:
            continue

        x = torch.randn(1, seq, cfg.hidden, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        bench.record(size, "KDA layer fwd+bwd (fla)", fwd_bwd(kda_layer, x), reps)
        bench.record(size, "DSA layer fwd+bwd (indexer + first fused sparse attention)", fwd_bwd(dsa_layer, x, lambda o: o[0]), reps)
        if seq <= 16384:
            # The first registered fused implementation is the one the layer runs: stand dense attention in for it.
            first = next(n for n in ops.implementations("dsa_sparse_attention") if n != ops.REFERENCE)
            saved = ops.implementations("dsa_sparse_attention")[first]
            ops.register("dsa_sparse_attention", first, dense_attention)
            try:
                bench.record(size, "DSA layer fwd+bwd, dense-attention fallback", fwd_bwd(dsa_layer, x, lambda o: o[0]), reps)
            finally:
                ops.register("dsa_sparse_attention", first, saved)
            with ops.policy("reference"):
                bench.record(size, "DSA layer fwd+bwd, PyTorch reference path", fwd_bwd(dsa_layer, x, lambda o: o[0]), 2)
        qs, ks, vs = (torch.randn(1, cfg.dsa.num_heads, seq, cfg.dsa.qk_head_dim, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        def sdpa():
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out.backward(torch.ones_like(out))
        bench.record(size, "dense causal SDPA fwd+bwd (4 heads x 128)", sdpa, reps)
        del qs, ks, vs

        ql = torch.randn(1, seq, cfg.dsa.num_heads, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(1, seq, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        with torch.no_grad():
            idx = fused(torch.randn(1, seq, ic.n_heads, ic.head_dim, device=DEV, dtype=torch.bfloat16),
                        torch.randn(1, seq // ic.kpool, ic.head_dim, device=DEV, dtype=torch.bfloat16),
                        torch.rand(1, seq, ic.n_heads, device=DEV), **kw)
        for impl, label in (("triton_sparse_mla", "Triton few-head"), ("tilelang_sparse_mla", "TileLang, W=2051->2112")):
            sparse = ops.implementations("dsa_sparse_attention")[impl]

            def attn(sparse=sparse):
                ql.grad = kv.grad = None
                out = sparse(ql, kv, idx, scale=cfg.dsa.softmax_scale)
                out.backward(torch.ones_like(out))
            bench.record(size, f"sparse attention op fwd+bwd ({label})", attn, reps)
        del ql, kv, idx
        bench.record(size, "MoE block fwd+bwd (grouped GEMM, 64 experts top-4)", fwd_bwd(moe_block, x), reps)
        del x
    print("\nkernel audit:", ops.audit_summary())
    print("\n".join(notes))
    print(f"\n{'size':>5} | {'case':<55} | {'ms':>9} | {'peak GiB':>8} | note")
    for r in bench.rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.1f}"
        pk = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['size']:>5} | {r['case']:<55} | {ms:>9} | {pk:>8} | {r['note'][:60]}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f} s")
