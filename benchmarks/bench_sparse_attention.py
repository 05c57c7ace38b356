"""DSA sparse attention, forward + backward, side by side on one GPU: genolong's few-head Triton
kernels (each forward / dkv mode) against megatron-core's padded TileLang kernel and dense causal SDPA.

    python benchmarks/bench_sparse_attention.py --out runs/sparse                   # < 5 min on a fresh H200
    python benchmarks/bench_sparse_attention.py --preset iter2 --out runs/sparse2   # the grouped kernels' cells, < 4 min
    python benchmarks/bench_sparse_attention.py --preset grouped-check --budget-s 160 --out runs/sparse2c  # parity + grouped vs default, < 200 s
    python benchmarks/bench_sparse_attention.py --preset split-adds --skip-parity --budget-s 290 --out runs/sparse3  # split products, layout adds

1. Parity (first, at 4096 tokens): every candidate launch config of each mode against the fp32
   reference at 4, 16 and 64 heads: relative error of out, dq, dkv and the max abs error of lse.
2. Timing, cells in priority order until the time budget is spent (each cell's cost is estimated
   from the cells before it; what does not fit is listed as skipped). A cell is (length, heads,
   implementation):
   - `triton-keychunk`, `triton-atomic`: v1 (one program per query forward; dkv key-chunked / atomic);
   - `triton-grouped`: the grouped forward and backward (one launch per key chunk, queries stacked);
   - `triton-fwd`, `triton-grouped-fwd`: the forward alone (v1 / grouped);
   - `megatron`, `megatron-fwd`: megatron-core's TileLang op (genolong/kernels/dsa_sparse_tilelang.py,
     W 2051 padded to 2112, q/kv to 576, heads to 16), with backward / forward alone;
   - `sdpa`: dense causal SDPA with the same heads, 128 wide;
   - probes (what a pass costs, not results): `probe-grouped-bwd` / `probe-keychunk-bwd` the backward
     alone (out and lse from one forward), `probe-grouped-bwd-nodkv` the grouped backward without
     the dkv products and adds (wrong gradients: the share of the fp32 adds), `probe-pack` the
     grouped passes' packing + sort + bounds of the whole selection (forward's and backward's key chunks).
   Default cells: the plan below x `--impls` (+ forward-only cells at 128k x 4 heads); `--cells`
   or `--preset` lists them explicitly.

Selections: the fused indexer's on random inputs (bench_kernels' recipe), kpool 4, 512 pools +
the tail: W = 2051; q, kv, dO random bf16. Times: median of CUDA-event-timed repeats after one
warm-up call (which pays compilation and the Triton kernels' config timing); peak = peak
allocated above what was allocated before (inputs excluded, outputs and transients included).

Useful FLOPs (the original work's count): forward 4*H*W*Dl per query (QK^T and PV), backward 8*H*W*Dl
(dP, dQ, and dKV's two products; the backward's recomputation of QK^T is not counted): 12*H*W*Dl
per query in all. SDPA: 6*H*d*T^2 (the causal half of 12*H*d*T^2). Results: <out>/bench.jsonl
(one line per cell as measured) and <out>/table.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import SIZES, measure  # noqa: E402

import genolong.kernels as kernels  # noqa: E402
from genolong.kernels import sparse_mla, sparse_mla_grouped, sparse_mla_triton  # noqa: E402
from genolong.model import get_preset, ops  # noqa: E402
from genolong.model.dsa import sparse_attention_reference  # noqa: E402

DEV = "cuda"
LATENT = 512
IMPLS = ("triton-keychunk", "triton-kcfwd", "triton-atomic", "triton-grouped", "megatron", "sdpa")
FWD_IMPLS = ("triton-fwd", "triton-kcfwd-fwd", "triton-grouped-fwd", "megatron-fwd")
# The key-chunked forward alone with another key chunk: triton-kcfwd<keys per chunk>-fwd; v1's
# forward alone with a pinned launch config: triton-cfg<HB>x<BN>x<warps>x<stages>-fwd.
KCFWD_PREFIX = "triton-kcfwd"
PROBES = ("probe-grouped-bwd", "probe-grouped-bwd-nodkv", "probe-keychunk-bwd", "probe-pack")
# v1's backward probes, any of: probe-{keychunk,atomic}-bwd[-nodkv|-store][-nopack][-layout][-kc<keys per chunk>][-cfg<config>]
# (-nodkv: no dkv products or adds; -store: plain stores instead of the adds; wrong dkv both;
# -nopack: q and dO kept apart (GENOLONG_SPARSE_MLA_PACK=off); -layout: the fp32 adds from the products'
# own layout (GENOLONG_SPARSE_MLA_ADDS=layout; default tl.atomic_add); -cfg: another pinned launch config, <HB>x<BN>x<warps>x<stages>, then
# k<slices> for products split over the latent columns (Config.split_k), t for the slot-major form).
PROBE_CONFIG = sparse_mla_triton.Config(16, 16, 4, 5)
PARITY_MODES = ("atomic", "keychunk", "grouped", "kcfwd")


def parse_config(text: str, slot_major: bool = False) -> sparse_mla_triton.Config | None:
    """<HB>x<BN>x<warps>x<stages>, then optionally k<slices> (Config.split_k) and, where `slot_major`
    is allowed, t: the launch config it names; None if it names none."""
    major = slot_major and text.endswith("t")
    text = text.removesuffix("t") if major else text
    text, k, split = text.partition("k")
    numbers = text.split("x")
    if len(numbers) != 4 or not all(n.isdigit() and int(n) > 0 for n in numbers) or (k and not (split.isdigit() and int(split) > 0)):
        return None
    return sparse_mla_triton.Config(*map(int, numbers), slot_major=major, split_k=int(split or 1))


def parse_probe(impl: str) -> tuple[str, str, int, sparse_mla_triton.Config, bool, str]:
    """(dkv mode, dkv op, key chunk, launch config, pack, adds) of a backward probe's name; SystemExit for a malformed one."""
    parts = impl.split("-")
    if len(parts) < 3 or parts[0] != "probe" or parts[1] not in ("keychunk", "atomic", "grouped") or parts[2] != "bwd":
        sys.exit(f"{impl}: not a backward probe (probe-{{keychunk,atomic,grouped}}-bwd[-nodkv|-store][-kcN][-cfgHBxBNxWxS[kN][t]])")
    dkv_op, key_chunk, config, pack, adds = "add", sparse_mla.KEY_CHUNK, PROBE_CONFIG, True, "coalesced"
    for extra in parts[3:]:
        pinned = parse_config(extra[3:], slot_major=True) if extra.startswith("cfg") else None
        if extra in ("nodkv", "store"):
            dkv_op = "skip" if extra == "nodkv" else "store"
        elif extra == "nopack":
            pack = False
        elif extra == "layout":
            adds = "layout"
        elif extra.startswith("kc") and extra[2:].isdigit() and int(extra[2:]) > 0:
            key_chunk = int(extra[2:])
        elif pinned:
            config = pinned
        else:
            sys.exit(f"{impl}: unknown probe option {extra!r} (nodkv, store, nopack, layout, kc<keys>, cfg<HB>x<BN>x<warps>x<stages>[k<slices>][t])")
    return parts[1], dkv_op, key_chunk, config, pack, adds


def is_impl(impl: str) -> bool:
    if impl in IMPLS + FWD_IMPLS + PROBES:
        return True
    if kcfwd_chunk(impl) or forward_config(impl):
        return True
    if impl.startswith("probe-") and impl != "probe-pack":
        parse_probe(impl)
        return True
    return False
def forward_config(impl: str) -> sparse_mla_triton.Config | None:
    """The pinned launch config of a triton-cfg<HB>x<BN>x<warps>x<stages>[k<slices>]-fwd cell (v1's forward
    alone with that config instead of the timed candidates); None for any other name."""
    if impl.startswith("triton-cfg") and impl.endswith("-fwd"):
        return parse_config(impl.removeprefix("triton-cfg").removesuffix("-fwd"))
    return None


def kcfwd_chunk(impl: str) -> int | None:
    """The keys per chunk of a triton-kcfwd<keys>-fwd cell (None for any other name)."""
    digits = impl.removeprefix(KCFWD_PREFIX).removesuffix("-fwd")
    if impl.startswith(KCFWD_PREFIX) and impl.endswith("-fwd") and digits.isdigit() and int(digits) > 0:
        return int(digits)
    return None


# impl -> (forward mode, dkv mode) of sparse_mla.sparse_mla
TRITON_MODES = {"triton-keychunk": ("query", "keychunk"), "triton-kcfwd": ("keychunk", "keychunk"), "triton-atomic": ("query", "atomic"),
                "triton-grouped": ("grouped", "grouped"), "triton-fwd": ("query", None), "triton-kcfwd-fwd": ("keychunk", None),
                "triton-grouped-fwd": ("grouped", None)}
# (size, heads) in priority order: the targets first (4 heads, 128k), 512k last.
PLAN = [("128k", 4), ("128k", 16), ("128k", 8), ("64k", 4), ("64k", 8), ("64k", 16), ("64k", 64),
        ("512k", 4), ("128k", 64), ("512k", 8), ("512k", 16)]
# The second iteration's cells (2026-12): the grouped kernels beside v1 in the same run, probes
# of where the grouped backward's time goes, one megatron cell for the ratio to the first run.
PRESETS = {
    "iter2": dict(parity_modes="grouped", cells=[
        ("128k", 4, "triton-grouped"), ("128k", 4, "triton-grouped-fwd"), ("128k", 4, "triton-keychunk"), ("128k", 4, "triton-fwd"),
        ("128k", 4, "probe-grouped-bwd"), ("128k", 4, "probe-grouped-bwd-nodkv"), ("128k", 4, "probe-pack"),
        ("512k", 4, "triton-grouped"), ("512k", 4, "triton-keychunk"),
        ("128k", 16, "triton-grouped"), ("128k", 16, "triton-keychunk"),
        ("64k", 64, "triton-grouped"), ("64k", 64, "triton-atomic"), ("64k", 64, "triton-grouped-fwd"), ("64k", 64, "triton-fwd"),
        ("512k", 4, "triton-grouped-fwd"), ("512k", 4, "triton-fwd"),
        ("128k", 4, "megatron")]),
    # Where v1's key-chunked backward spends its time (2026-12-02): without the dkv
    # adds, with plain stores instead, the one-pass (atomic) layout, other key chunk sizes; the
    # forward for its gathers alone. Probes only (no parity, no megatron): < 2 min cold.
    "bwd-probe": dict(parity_modes="keychunk", cells=[
        ("128k", 4, "probe-keychunk-bwd"), ("128k", 4, "probe-keychunk-bwd-nodkv"), ("128k", 4, "probe-keychunk-bwd-store"),
        ("128k", 4, "probe-atomic-bwd"), ("128k", 4, "probe-atomic-bwd-nodkv"), ("128k", 4, "triton-fwd"),
        ("128k", 4, "probe-keychunk-bwd-kc2048"), ("128k", 4, "probe-keychunk-bwd-kc4096"), ("128k", 4, "probe-keychunk-bwd-kc16384"),
        ("128k", 16, "probe-keychunk-bwd"), ("128k", 16, "probe-keychunk-bwd-nodkv"),
        ("512k", 4, "probe-keychunk-bwd"), ("512k", 4, "probe-keychunk-bwd-kc4096"), ("512k", 4, "probe-keychunk-bwd-nodkv")]),
    # The key-chunked forward (fwd_mode "keychunk", 2026-12-03) beside v1's query
    # forward and the grouped one: forward alone at its default key chunk (32,768) and others, then
    # forward + backward with the default backward; parity of its configs first. No TileLang.
    "kcfwd": dict(parity_modes="kcfwd", cells=[
        ("128k", 4, "triton-kcfwd-fwd"), ("128k", 4, "triton-fwd"), ("128k", 4, "triton-kcfwd16384-fwd"),
        ("128k", 4, "triton-grouped-fwd"), ("128k", 4, "triton-kcfwd"), ("128k", 4, "triton-keychunk"),
        ("512k", 4, "triton-kcfwd-fwd"), ("512k", 4, "triton-fwd"), ("512k", 4, "triton-kcfwd16384-fwd"),
        ("128k", 16, "triton-kcfwd-fwd"), ("128k", 16, "triton-fwd"), ("128k", 8, "triton-kcfwd-fwd"), ("128k", 8, "triton-fwd"),
        ("64k", 64, "triton-kcfwd-fwd"), ("64k", 64, "triton-fwd"), ("128k", 4, "triton-kcfwd8192-fwd"),
        ("512k", 4, "triton-kcfwd"), ("512k", 4, "triton-keychunk")]),
    # The grouped passes' parity on the GPU and their time beside the default (v1 keychunk) at
    # 128k for 4, 16 and 64 heads, then 512k at 4 heads: no TileLang, no probes (< 200 s cold).
    "grouped-check": dict(parity_modes="grouped", cells=[
        ("128k", 4, "triton-grouped"), ("128k", 4, "triton-keychunk"), ("128k", 16, "triton-grouped"),
        ("128k", 16, "triton-keychunk"), ("128k", 64, "triton-grouped"), ("128k", 64, "triton-keychunk"),
        ("512k", 4, "triton-grouped"), ("512k", 4, "triton-keychunk")]),
    # The split score products (Config.split_k) and the adds in the products' layout
    # (GENOLONG_SPARSE_MLA_ADDS=layout): each backward beside the
    # default backward, each forward beside the default's pinned config, at 4, 64 and 16 heads; the
    # default op last. Parity is tests/gpu/test_sparse_mla.py -k split (run with --skip-parity).
    "split-adds": dict(parity_modes="keychunk", cells=[
        ("128k", 4, "probe-keychunk-bwd"), ("128k", 4, "probe-keychunk-bwd-layout"),
        # the dkv part: the packed backward without it
        ("128k", 4, "probe-keychunk-bwd-nodkv"),
        ("128k", 4, "probe-keychunk-bwd-cfg16x16x4x5k4"), ("128k", 4, "probe-keychunk-bwd-layout-cfg16x16x4x5k4"),
        ("128k", 4, "triton-cfg16x32x8x5-fwd"), ("128k", 4, "triton-cfg16x32x8x5k8-fwd"),
        ("128k", 4, "triton-cfg16x32x4x5k4-fwd"), ("128k", 4, "triton-cfg16x16x4x5k4-fwd"),
        ("512k", 4, "probe-keychunk-bwd"), ("512k", 4, "probe-keychunk-bwd-layout"),
        ("512k", 4, "probe-keychunk-bwd-layout-cfg16x16x4x5k4"),
        ("64k", 64, "probe-keychunk-bwd-cfg32x16x8x5"), ("64k", 64, "probe-keychunk-bwd-layout-cfg32x16x8x5"),
        ("64k", 64, "probe-keychunk-bwd-layout-cfg32x16x8x5k8"), ("64k", 64, "triton-cfg64x32x8x5-fwd"),
        ("64k", 64, "triton-cfg32x16x8x5k8-fwd"),
        # (at 16 heads the 8-warp build, which the default's trials pick among, beside the 8-slice split)
        ("128k", 16, "probe-keychunk-bwd-cfg16x16x8x5"), ("128k", 16, "probe-keychunk-bwd-layout-cfg16x16x8x5"),
        ("128k", 16, "probe-keychunk-bwd-layout-cfg16x16x8x5k8"), ("128k", 4, "triton-keychunk")]),
}
TILELANG_BUILD_S = 110  # a TileLang build of megatron's forward + backward for a new head count


def selection(seq: int) -> torch.Tensor:
    ic = get_preset("glm53-mini").dsa.indexer
    fused = ops.implementations("dsa_indexer_topk")["triton_two_pass"]
    with torch.no_grad():
        return fused(torch.randn(1, seq, ic.n_heads, ic.head_dim, device=DEV, dtype=torch.bfloat16),
                     torch.randn(1, seq // ic.kpool, ic.head_dim, device=DEV, dtype=torch.bfloat16),
                     torch.rand(1, seq, ic.n_heads, device=DEV), kpool=ic.kpool, topk_pools=ic.topk_pools,
                     always_select_tail=ic.always_select_tail, softmax_scale=ic.head_dim**-0.5)


def sparse_fn(impl: str, scale: float):
    if impl.startswith("megatron"):
        tilelang = ops.implementations("dsa_sparse_attention")["tilelang_sparse_mla"]
        return lambda q, kv, idx: tilelang(q, kv, idx, scale=scale)
    if kcfwd_chunk(impl):
        return lambda q, kv, idx: sparse_mla.sparse_mla(q, kv, idx, scale=scale, fwd_mode="keychunk", fwd_key_chunk=kcfwd_chunk(impl))
    if forward_config(impl):
        return lambda q, kv, idx: sparse_mla.sparse_mla(q, kv, idx, scale=scale, configs={"fwd": forward_config(impl)})
    fwd_mode, dkv_mode = TRITON_MODES[impl]
    return lambda q, kv, idx: sparse_mla.sparse_mla(q, kv, idx, scale=scale, fwd_mode=fwd_mode, dkv_mode=dkv_mode or "atomic")


def lse_reference(q, kv, idx, scale, rows=256):
    out = []
    for t0 in range(0, q.shape[1], rows):
        i = idx[0, t0 : t0 + rows].long()
        s = torch.einsum("thd,twd->thw", q[0, t0 : t0 + rows].float(), kv[0].float()[i.clamp(min=0)]) * scale
        out.append(s.masked_fill((i < 0)[:, None], float("-inf")).logsumexp(-1))
    return torch.cat(out)


def parity(scale: float, log, modes: list[str]) -> None:
    """Every candidate launch config of each dkv mode (with its forward: grouped with grouped,
    v1's otherwise) against the fp32 reference; this also compiles them all, so the timing cells
    below only time them."""
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
        for mode in modes:
            # "kcfwd": the key-chunked forward's configs, with the key-chunked backward's
            fwd_mode = {"grouped": "grouped", "kcfwd": "keychunk"}.get(mode, "query")
            fwd_kind = {"grouped": "fwd_grouped", "kcfwd": "fwd_keychunk"}.get(mode, "fwd")
            fwd = sparse_mla.candidates(fwd_kind, heads, LATENT)
            bwd = sparse_mla.candidates("bwd_grouped" if mode == "grouped" else "bwd", heads, LATENT)
            for n in range(max(len(fwd), len(bwd))):
                configs = {"fwd": fwd[min(n, len(fwd) - 1)], "bwd": bwd[min(n, len(bwd) - 1)]}
                a, b = q.clone().requires_grad_(), kv.clone().requires_grad_()
                out, lse = sparse_mla.sparse_mla(a, b, idx, scale=scale, return_lse=True, dkv_mode="keychunk" if mode == "kcfwd" else mode,
                                                 fwd_mode=fwd_mode,
                                                 key_chunk=1024, configs=configs)
                out.backward(dout)
                err = {name: ((x.float() - r).norm() / r.norm()).item() for name, x, r in
                       (("out", out, ref), ("dq", a.grad, qf.grad), ("dkv", b.grad, kvf.grad))}
                err["lse_abs"] = (lse[0] - lse_ref).abs().max().item()
                ok = max(err["out"], err["dq"], err["dkv"]) <= 1e-2 and err["lse_abs"] <= 1e-2
                log(dict(kind="parity", heads=heads, mode=mode, seq=seq, ok=ok, fwd=configs["fwd"].label(), bwd=configs["bwd"].label(),
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
    if impl == "probe-pack":
        group = sparse_mla.candidates("fwd_grouped", heads, LATENT)[0].query_group
        flat = idx[0]
        return lambda: [sparse_mla_grouped.pack(flat, group, seq, chunk) for chunk in (2 * sparse_mla.KEY_CHUNK, sparse_mla.KEY_CHUNK)]
    if (kcfwd_chunk(impl) or 2 * sparse_mla.KEY_CHUNK) >= seq and impl.startswith(KCFWD_PREFIX):
        # One key chunk: the op runs the query forward, which this cell would mislabel.
        raise ValueError(f"{impl} at {seq} keys is one key chunk: the query forward would run")
    q = torch.randn(1, seq, heads, LATENT, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, seq, LATENT, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, seq, heads, LATENT, device=DEV, dtype=torch.bfloat16)
    if impl.startswith("probe-"):
        with torch.no_grad():
            out, lse = sparse_mla._forward(q.detach(), kv.detach(), idx, scale)
        mode, dkv_op, key_chunk, config, pack, adds = parse_probe(impl)
        # v1's probes pin one launch config (by default the one the H200 chose for the key-chunked
        # pass, 2026-12-01), so that they time the same build and leave no choice behind for the cells.
        config = None if mode == "grouped" else config

        def probe():
            saved = {name: os.environ.get(name) for name in (sparse_mla.ENV_PACK, sparse_mla.ENV_RED)}
            os.environ[sparse_mla.ENV_PACK] = "on" if pack else "off"
            os.environ[sparse_mla.ENV_RED] = adds
            try:
                sparse_mla._backward(q.detach(), kv.detach(), idx, out, lse, dout, scale, mode, key_chunk,
                                     sparse_mla.QUERY_BUDGET_BYTES, config, dkv_op)
            finally:  # the caller's own settings back, for the cells after the probes
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        return probe
    fn = sparse_fn(impl, scale)
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
    ap.add_argument("--impls", default="triton-grouped,triton-keychunk,triton-atomic,megatron,sdpa")
    ap.add_argument("--plan", default="", help="size:heads,... instead of the default plan")
    ap.add_argument("--cells", default="", help="size:heads:impl,... in priority order (instead of plan x impls)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named list of cells and parity modes")
    ap.add_argument("--parity-modes", default="atomic,keychunk,grouped",
                    help=f"what the parity checks: {', '.join(PARITY_MODES)} (dkv modes; kcfwd: the key-chunked forward with the keychunk backward)")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--tilelang-cached", default="", help="head counts whose TileLang builds are in the cache (no build time budgeted)")
    args = ap.parse_args()
    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    kernels.load()
    scale = get_preset("glm53-mini").dsa.softmax_scale
    if args.preset:
        cells = PRESETS[args.preset]["cells"]
        parity_modes = PRESETS[args.preset]["parity_modes"].split(",")
    else:
        parity_modes = [m for m in args.parity_modes.split(",") if m]
        if set(parity_modes) - set(PARITY_MODES):
            sys.exit(f"unknown parity modes {sorted(set(parity_modes) - set(PARITY_MODES))}; known: {', '.join(PARITY_MODES)}")
        if args.cells:
            cells = [(s, int(h), i) for s, h, i in (c.split(":") for c in args.cells.split(",") if c)]
        else:
            impls = [i for i in args.impls.split(",") if i]
            plan = [(s, int(h)) for s, h in (p.split(":") for p in args.plan.split(",") if p)] or PLAN
            extra = [f"{i}-fwd" for i in ("triton", "megatron") if any(x.startswith(i) for x in impls)]
            cells = [(s, h, i) for s, h in plan for i in impls + (extra if (s, h) == ("128k", 4) else [])]
    unknown = {i for _, _, i in cells if not is_impl(i)}
    if unknown:
        sys.exit(f"unknown implementations {sorted(unknown)}; known: {', '.join(IMPLS + FWD_IMPLS + PROBES)}, "
                 "triton-kcfwd<keys>-fwd, triton-cfg<HB>x<BN>x<warps>x<stages>-fwd, probe-{keychunk,atomic,grouped}-bwd[-...]")
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
        parity(scale, log, parity_modes)
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
            lines.append(f"parity {r['heads']:>2} heads, {r['mode']:<8} {r['fwd']} {r['bwd']}: out {r['out']:.2e} dq {r['dq']:.2e} dkv {r['dkv']:.2e} "
                         f"lse {r['lse_abs']:.2e}  {'ok' if r['ok'] else 'FAILED (> 1e-2)'}")
    cells = {(r["size"], r["heads"], r["impl"]): r for r in rows if r["kind"] in ("time", "error", "skipped")}
    keys = sorted({(s, h) for s, h, _ in cells}, key=lambda k: (SIZES[k[0]], k[1]))
    named = list(IMPLS + FWD_IMPLS + PROBES)
    present = [i for i in named if any(c[2] == i for c in cells)]
    present += sorted({c[2] for c in cells} - set(named))  # v1's parametrised probes

    def show(r):
        if r is None:
            return "-"
        if r["kind"] != "time":
            return r["kind"]
        tf = f" ({r['useful_tflops']:.0f})" if "useful_tflops" in r else ""
        return f"{r['ms']:.1f}{tf} {r['peak_gib']:.1f}"

    lines.append("")
    lines.append("ms (useful TFLOP/s) peak GiB; *-fwd: forward alone; probe-*: one pass or stage alone (not a result)")
    lines.append("size | heads | " + " | ".join(present) + " | grouped vs keychunk | best Triton vs megatron")
    for size, heads in keys:
        got = {i: cells.get((size, heads, i)) for i in present}
        ms = {i: r["ms"] for i, r in got.items() if r and r["kind"] == "time"}
        vs_v1 = f"{ms['triton-keychunk'] / ms['triton-grouped']:.2f}x" if {"triton-keychunk", "triton-grouped"} <= ms.keys() else "-"
        best = min((ms[i] for i in ("triton-keychunk", "triton-atomic", "triton-grouped") if i in ms), default=None)
        vs_megatron = f"{ms['megatron'] / best:.2f}x" if best and "megatron" in ms else "-"
        lines.append(f"{size} | {heads} | " + " | ".join(show(got[i]) for i in present) + f" | {vs_v1} | {vs_megatron}")
    skipped = [f"{r['size']}/{r['heads']}/{r['impl']}" for r in rows if r["kind"] == "skipped"]
    if skipped:
        lines.append(f"\nskipped (time budget): {', '.join(skipped)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
