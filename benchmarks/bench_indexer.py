"""The DSA indexer alone on one GPU (glm53-mini shapes): fused variants side by side with the
plain query-chunked PyTorch version, their time split by stage, and their selections compared.

    python benchmarks/bench_indexer.py --sizes 512k --extra 1M --out runs/indexer

Cases at each size (forward only: the indexer is frozen):
- plain: the issue's version (einsum over heads + relu + weighted head sum + causal mask + topk
  over the [8k, pools] block, 8k queries per chunk), `bench_kernels.baseline_indexer`;
- fused G=<g> [sorted]: the registered two-pass path (pass 1 group maxima, top groups, pass 2
  candidate rescoring, final top-k), with G pools per group, top-k results sorted or not;
- for each fused variant, its cumulative stage times (pass 1; + top groups; + pass 2; + final top-k).
Each variant's selection is checked against the default one on the same input (pool sets per query).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import SIZES, baseline_indexer, measure  # noqa: E402

from genolong.kernels import indexer_topk, indexer_triton  # noqa: E402
from genolong.model import get_preset  # noqa: E402


def stages(q, keys, w, *, kpool, topk_pools, scale, group, sorted_topk, upto):
    """The fused chunk loop stopped after stage `upto` (1 pass 1, 2 top groups, 3 pass 2, 4 final top-k)."""
    seq, n_pools = q.shape[1], keys.shape[1]
    width = indexer_topk.out_width(kpool, topk_pools, True)
    rows = indexer_topk.chunk_rows(-(-n_pools // group) * 8 + topk_pools * (group * 4 + 24) + width * 8, indexer_topk.BUDGET_BYTES)
    for t0 in range(0, seq, rows):
        t1 = min(seq, t0 + rows)
        t = torch.arange(t0, t1, device=q.device)
        qc, kc, wc = q[0, t0:t1], keys[0, : min(n_pools, t1 // kpool)], w[0, t0:t1]
        gmax = indexer_triton.group_max(qc, kc, wc, t, kpool=kpool, scale=scale, group=group)
        if upto >= 2:
            top = gmax.topk(min(topk_pools, gmax.shape[1]), dim=-1, sorted=sorted_topk)
        if upto >= 3:
            cand = indexer_triton.candidate_scores(qc, kc, wc, t, top.indices, top.values, kpool=kpool, scale=scale, group=group)
        if upto >= 4:
            cand.topk(min(topk_pools, cand.shape[1]), dim=-1, sorted=sorted_topk)


def pool_sets(out: torch.Tensor, kpool: int, rows: torch.Tensor) -> list[set]:
    sel = out[0, rows].long()
    return [set((r[r >= 0] // kpool).tolist()) for r in sel]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512k")
    ap.add_argument("--extra", default="1M", help="sizes at which only the default fused variant runs")
    ap.add_argument("--variants", default="8:sorted,8,4,16")
    ap.add_argument("--out", type=Path, default=Path("runs/indexer"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "indexer.jsonl").open("a")
    ic = get_preset("glm53-mini").dsa.indexer
    kw = dict(kpool=ic.kpool, topk_pools=ic.topk_pools, always_select_tail=ic.always_select_tail, softmax_scale=ic.head_dim**-0.5)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows_out = []

    def record(size, case, fn, reps):
        try:
            ms, peak = measure(fn, reps)
            row = dict(size=size, case=case, ms=round(ms, 2), peak_gib=round(peak, 2))
        except torch.cuda.OutOfMemoryError as why:
            row = dict(size=size, case=case, ms=None, peak_gib=None, note=str(why).splitlines()[0][:160])
        torch.cuda.empty_cache()
        rows_out.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)

    variants = []
    for v in args.variants.split(","):
        g, _, srt = v.partition(":")
        variants.append((int(g), srt == "sorted"))
    extra = [s for s in args.extra.split(",") if s]
    for size in [s for s in args.sizes.split(",") if s] + extra:
        seq = SIZES[size]
        torch.manual_seed(seq)
        # Positive-mean q and keys (few relu zeros, so few tied scores), random head weights.
        q = (torch.randn(1, seq, ic.n_heads, ic.head_dim, device="cuda") * 0.3 + 0.2).bfloat16()
        keys = (torch.randn(1, seq // ic.kpool, ic.head_dim, device="cuda") * 0.3 + 0.2).bfloat16()
        w = torch.randn(1, seq, ic.n_heads, device="cuda") * ic.n_heads**-0.5
        reps = 3
        if size in extra:
            record(size, "fused G=8", lambda: indexer_topk.indexer_two_pass(
                q, keys, w, group_max=indexer_triton.group_max, candidate_scores=indexer_triton.candidate_scores, **kw), reps)
            continue
        record(size, "plain chunked PyTorch (8k queries)",
               lambda: baseline_indexer(q, keys, w, kpool=ic.kpool, topk_pools=ic.topk_pools, scale=ic.head_dim**-0.5), 2)
        check_rows = torch.linspace(0, seq - 1, 256, device="cuda").long()
        ref_sets = None
        for group, srt in variants:
            name = f"fused G={group}{' sorted' if srt else ''}"

            def run(group=group, srt=srt):
                return indexer_topk.indexer_two_pass(q, keys, w, group=group, group_max=indexer_triton.group_max,
                                                     candidate_scores=indexer_triton.candidate_scores, sorted_topk=srt, **kw)
            record(size, name, run, reps)
            sets = pool_sets(run(), ic.kpool, check_rows)
            if ref_sets is None:
                ref_sets = sets
            else:
                differ = sum(a != b for a, b in zip(sets, ref_sets))
                print(f"{size} {name}: {differ} of {len(sets)} sampled rows select other pools than the first variant", flush=True)
            for upto, label in ((1, "pass 1"), (2, "+ top groups"), (3, "+ pass 2"), (4, "+ final top-k")):
                record(size, f"{name} stages: {label}",
                       lambda upto=upto, group=group, srt=srt: stages(q, keys, w, kpool=ic.kpool, topk_pools=ic.topk_pools,
                                                                      scale=ic.head_dim**-0.5, group=group, sorted_topk=srt, upto=upto), reps)
        del q, keys, w
    print(f"\n{'size':>5} | {'case':<44} | {'ms':>9} | peak GiB")
    for r in rows_out:
        print(f"{r['size']:>5} | {r['case']:<44} | {r['ms'] if r['ms'] is not None else '-':>9} | {r['peak_gib']}")


if __name__ == "__main__":
    main()
