"""The DSA indexer alone on one GPU: the v2 Triton path beside v1 and the plain query-chunked PyTorch
version, their time split by stage, v2's pass-1 tile shapes, and their selections compared.

    source .device/activate.sh && python benchmarks/bench_indexer.py --sizes 512k --extra 1M --out $OUT/indexer

Cases at each --sizes length (forward only: the indexer is frozen; glm53-mini's 4 x 128 heads,
or --heads 32 for GLM-5.3-Flash's):
- plain: the original work's version (einsum over heads + relu + weighted head sum + causal mask + topk
  over the [8k, pools] block, 8k queries per chunk), `bench_kernels.baseline_indexer`;
- v1 G=<g> [sorted]: the two-pass path with two `torch.topk` calls (`indexer_two_pass`);
- v2 G=<g>: per-head pass 1 with pipelined key loads (group and super-group maxima), the top
  groups chosen by a selection kernel, pass 2 choosing the final top-k and writing the token
  indices itself (`indexer_fused_select`): no torch.topk;
- for each variant its cumulative stage times: v1 pass 1; + top groups; + pass 2; + final top-k
  (the expansion to token indices is the rest of the total); v2 pass 1; + select groups; + select;
- v2 pass 1 alone with other tile shapes (BM x BN, warps, stages), each checked against the default.
At --extra lengths only v1 and v2 at G=8 run (totals). Selections are compared with the first
variant on 256 sampled rows (pool sets); they may differ only on fp32 near-ties. Every row goes to
<out>/indexer.jsonl as it is measured; a table prints last. ~2.5 min at 512k + 1M on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import SIZES, baseline_indexer, measure  # noqa: E402

from genolong.kernels.indexer import topk as indexer_topk
from genolong.kernels.indexer import triton_kernels as indexer_triton  # noqa: E402
from genolong.model import get_preset  # noqa: E402

# Pass 1 v2 tiles (BM, BN, warps, stages), the default first; each fits sm_90's shared memory.
TILES = indexer_triton.PASS1_TILES


def chunks(q, keys, *, kpool, topk_pools, group, v2):
    """The chunk loop of the registered paths: (q, keys, w slices, positions) per query chunk."""
    seq, n_pools = q.shape[1], keys.shape[1]
    width = indexer_topk.out_width(kpool, topk_pools, True)
    n_groups = -(-n_pools // group)
    per_row = n_groups * 8 + topk_pools * (group * 4 + 16) if v2 else n_groups * 8 + topk_pools * (group * 4 + 24) + width * 8
    rows = indexer_topk.chunk_rows(per_row, indexer_topk.BUDGET_BYTES)
    for t0 in range(0, seq, rows):
        t1 = min(seq, t0 + rows)
        yield t0, t1, torch.arange(t0, t1, device=q.device), min(n_pools, t1 // kpool)


def stages_v1(q, keys, w, *, kpool, topk_pools, scale, group, sorted_topk, upto):
    """v1 stopped after stage `upto` (1 pass 1, 2 top groups, 3 pass 2, 4 final top-k)."""
    for t0, t1, t, visible in chunks(q, keys, kpool=kpool, topk_pools=topk_pools, group=group, v2=False):
        qc, kc, wc = q[0, t0:t1], keys[0, :visible], w[0, t0:t1]
        gmax = indexer_triton.group_max(qc, kc, wc, t, kpool=kpool, scale=scale, group=group)
        if upto >= 2:
            top = gmax.topk(min(topk_pools, gmax.shape[1]), dim=-1, sorted=sorted_topk)
        if upto >= 3:
            cand = indexer_triton.candidate_scores(qc, kc, wc, t, top.indices, top.values, kpool=kpool, scale=scale, group=group)
        if upto >= 4:
            cand.topk(min(topk_pools, cand.shape[1]), dim=-1, sorted=sorted_topk)


def stages_v2(q, keys, w, out, *, kpool, topk_pools, scale, group, upto, tile=None):
    """v2 stopped after stage `upto` (1 pass 1, 2 select groups, 3 select = everything)."""
    bm, bn, warps, stages = tile or TILES[0]
    for t0, t1, t, visible in chunks(q, keys, kpool=kpool, topk_pools=topk_pools, group=group, v2=True):
        qc, kc, wc = q[0, t0:t1], keys[0, :visible], w[0, t0:t1]
        maxima = indexer_triton.group_max_v2(qc, kc, wc, t, kpool=kpool, scale=scale, group=group, bm=bm, bn=bn,
                                             warps=warps, stages=stages)
        if upto >= 2:
            gidx, gval = indexer_triton.select_groups(maxima, topk_pools)
        if upto >= 3:
            indexer_triton.select_candidates(qc, kc, wc, t, gidx, gval, out[0, t0:t1], kpool=kpool, scale=scale,
                                             group=group, topk_pools=topk_pools, always_select_tail=True)


def parse_variant(text: str) -> tuple[str, int, bool]:
    """'v1:8', 'v1:8:sorted' or 'v2:4' -> (version, group, sorted)."""
    version, group, *rest = text.split(":")
    ok = version in ("v1", "v2") and group.isdigit() and rest in ([], ["sorted"]) and not (version == "v2" and rest)
    if not ok:
        raise SystemExit(f"--variants: {text!r} is not v1:<G>[:sorted] or v2:<G>")
    return version, int(group), rest == ["sorted"]


def pool_sets(out: torch.Tensor, kpool: int, rows: torch.Tensor) -> list[set]:
    sel = out[0, rows].long()
    return [set((r[r >= 0] // kpool).tolist()) for r in sel]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512k")
    ap.add_argument("--extra", default="1M", help="sizes at which only v1 and v2 at G=8 run")
    ap.add_argument("--variants", default="v2:8,v1:8,v2:16,v1:8:sorted")
    ap.add_argument("--heads", type=int, default=None, help="indexer heads (default glm53-mini's 4; 32 = GLM-5.3-Flash)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain PyTorch version (~10 s at 512k)")
    ap.add_argument("--no-tiles", action="store_true", help="skip the pass-1 tile sweep")
    ap.add_argument("--out", type=Path, default=Path("runs/indexer"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "indexer.jsonl").open("a")
    ic = get_preset("glm53-mini").dsa.indexer
    heads = args.heads or ic.n_heads
    scale = ic.head_dim**-0.5
    kw = dict(kpool=ic.kpool, topk_pools=ic.topk_pools, always_select_tail=ic.always_select_tail, softmax_scale=scale)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, indexer {heads} x {ic.head_dim}", flush=True)
    rows_out = []

    def record(size, case, fn, reps, **extra):
        try:
            ms, peak = measure(fn, reps)
            row = dict(size=size, case=case, ms=round(ms, 2), peak_gib=round(peak, 2), **extra)
        except torch.cuda.OutOfMemoryError as why:
            row = dict(size=size, case=case, ms=None, peak_gib=None, note=str(why).splitlines()[0][:160])
        torch.cuda.empty_cache()
        rows_out.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)

    def full(version, group, srt, q, keys, w):
        if version == "v2":
            return lambda: indexer_topk.indexer_fused_select(q, keys, w, group=group, group_max=indexer_triton.group_max_v2,
                                                             select_groups=indexer_triton.select_groups,
                                                             select=indexer_triton.select_candidates, **kw)
        return lambda: indexer_topk.indexer_two_pass(q, keys, w, group=group, group_max=indexer_triton.group_max,
                                                     candidate_scores=indexer_triton.candidate_scores, sorted_topk=srt, **kw)

    variants = [parse_variant(v) for v in args.variants.split(",")]
    extra = [s for s in args.extra.split(",") if s]
    for size in [s for s in args.sizes.split(",") if s] + extra:
        seq = SIZES[size]
        torch.manual_seed(seq)
        # Positive-mean q and keys (few relu zeros, so few tied scores), random head weights.
        q = (torch.randn(1, seq, heads, ic.head_dim, device="cuda") * 0.3 + 0.2).bfloat16()
        keys = (torch.randn(1, seq // ic.kpool, ic.head_dim, device="cuda") * 0.3 + 0.2).bfloat16()
        w = torch.randn(1, seq, heads, device="cuda") * heads**-0.5
        reps = 3
        if size in extra:
            for version in ("v2", "v1"):
                record(size, f"{version} G=8", full(version, 8, False, q, keys, w), reps)
            continue
        if not args.no_plain:
            record(size, "plain chunked PyTorch (8k queries)",
                   lambda: baseline_indexer(q, keys, w, kpool=ic.kpool, topk_pools=ic.topk_pools, scale=scale), 2)
        check_rows = torch.linspace(0, seq - 1, 256, device="cuda").long()
        ref_sets = None
        for version, group, srt in variants:
            name = f"{version} G={group}{' sorted' if srt else ''}"
            run = full(version, group, srt, q, keys, w)
            record(size, name, run, reps)
            sets = pool_sets(run(), ic.kpool, check_rows)
            if ref_sets is None:
                ref_sets, ref_name = sets, name
            else:
                differ = sum(a != b for a, b in zip(sets, ref_sets))
                print(f"{size} {name}: {differ} of {len(sets)} sampled rows select other pools than {ref_name}", flush=True)
            if version == "v1":
                for upto, label in ((1, "pass 1"), (2, "+ top groups"), (3, "+ pass 2"), (4, "+ final top-k")):
                    record(size, f"{name} stages: {label}",
                           lambda upto=upto, group=group, srt=srt: stages_v1(q, keys, w, kpool=ic.kpool, topk_pools=ic.topk_pools, scale=scale,
                                                                             group=group, sorted_topk=srt, upto=upto), reps)
            else:
                out = torch.empty(1, seq, indexer_topk.out_width(ic.kpool, ic.topk_pools, True), dtype=torch.int32, device="cuda")
                for upto, label in ((1, "pass 1"), (2, "+ select groups"), (3, "+ select (pass 2, top-k, expansion)")):
                    record(size, f"{name} stages: {label}",
                           lambda upto=upto, group=group, out=out: stages_v2(
                               q, keys, w, out, kpool=ic.kpool, topk_pools=ic.topk_pools, scale=scale, group=group, upto=upto),
                           reps)
                del out
        if not args.no_tiles:
            n = min(seq, 65536)
            t = torch.arange(seq - n, seq, device="cuda")
            ref = indexer_triton.group_max_v2(q[0, -n:], keys[0], w[0, -n:], t, kpool=ic.kpool, scale=scale, group=8)[0]
            for tile in TILES:
                bm, bn, warps, stages = tile
                got = indexer_triton.group_max_v2(q[0, -n:], keys[0], w[0, -n:], t, kpool=ic.kpool, scale=scale, group=8,
                                                  bm=bm, bn=bn, warps=warps, stages=stages)[0]
                same = bool(torch.equal(got, ref)) or float((got - ref).abs().nan_to_num().max()) <= 1e-5 * float(ref[ref.isfinite()].abs().max())
                record(size, f"v2 pass 1, last {n // 1024}k queries, BM {bm} BN {bn} warps {warps} stages {stages}",
                       lambda bm=bm, bn=bn, warps=warps, stages=stages: indexer_triton.group_max_v2(
                           q[0, -n:], keys[0], w[0, -n:], t, kpool=ic.kpool, scale=scale, group=8, bm=bm, bn=bn, warps=warps, stages=stages),
                       reps, matches_default=same)
        del q, keys, w
    print(f"\n{'size':>5} | {'case':<66} | {'ms':>9} | peak GiB")
    for r in rows_out:
        print(f"{r['size']:>5} | {r['case']:<66} | {r['ms'] if r['ms'] is not None else '-':>9} | {r['peak_gib']}"
              + ("" if r.get("matches_default", True) else "  DIFFERS FROM THE DEFAULT TILE"))


if __name__ == "__main__":
    main()
