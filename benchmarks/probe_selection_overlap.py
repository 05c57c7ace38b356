"""How much neighbouring queries' DSA selections overlap, on real DNA: would a sparse-MLA backward
that walks the *union* of a query group's selections move fewer bytes than v1's?

    python benchmarks/probe_selection_overlap.py --data /tmp/bundled --seq 128k --out $OUT/overlap

DSA selects pools of consecutive keys per query. v1's backward (genolong/kernels/sparse_mla/op.py)
handles every (query, slot) pair on its own: each selected key row is gathered and its fp32 dkv
row added once per query that selected it. A "union" backward would let G queries (G x heads =
16: the tensor-core rows v1 pads 4 heads to anyway) share one walk over the distinct keys of
their selections, with a bit mask per key saying which of them selected it: each distinct key
gathered and added once per group. With no overlap that is v1's cost; with full overlap 1/G of
it. Its gain is the ratio (selected pairs) / (distinct keys of the group's union) measured here.

glm53-mini (random initial weights, as bench_train starts) reads one real DNA window of --seq
tokens without gradients; every DSA layer's selection is captured, and for groups of G
consecutive queries (and, over the last quarter of the queries, groups of queries with similar
selections, side by side after sorting by min-hashes) the ratio is recorded; the same for
bench_sparse_attention's selection (the fused indexer on random inputs). Rows: <out>/overlap.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from genolong.errors import GenolongError  # noqa: E402
from genolong.units import parse_length  # noqa: E402

GROUPS = (2, 4, 8, 16)

BUDGET_BYTES = 1 << 29  # transient bytes of one piece of the sort


def distinct_keys(idx: torch.Tensor, group: int, *, budget_bytes: int = BUDGET_BYTES) -> torch.Tensor:
    """int64 [rows / group]: how many distinct keys each group of `group` consecutive rows of idx
    (int32 key indices, -1 empty) selects between them: the length of the union walk."""
    if idx.ndim != 2 or idx.dtype != torch.int32:
        raise GenolongError(f"expected int32 [rows, width] key indices, got {idx.dtype} {tuple(idx.shape)}")
    rows, width = idx.shape
    if group < 1 or rows % group:
        raise GenolongError(f"a group of {group} queries must divide the {rows} rows")
    n_groups, span = rows // group, group * width
    step = max(1, budget_bytes // max(1, span * 16))
    counts = []
    for g0 in range(0, n_groups, step):
        g1 = min(n_groups, g0 + step)
        keys = idx[g0 * group:g1 * group].reshape(g1 - g0, span).sort(dim=1).values  # -1 first
        live = keys >= 0
        new = live.clone()
        new[:, 1:] &= keys[:, 1:] != keys[:, :-1]
        counts.append(new.sum(1))
    return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64, device=idx.device)


def overlap(idx: torch.Tensor, group: int) -> dict:
    """Selected (query, key) pairs over the groups' distinct keys: how many times fewer key rows a
    union pass would gather and add than v1. A key one row selects twice counts once."""
    rows = idx.shape[0] // group * group
    pairs = int((idx[:rows] >= 0).sum().item())
    distinct = int(distinct_keys(idx[:rows].contiguous(), group).sum().item())
    return dict(group=group, pairs=pairs, distinct=distinct, ratio=pairs / max(1, distinct))


def capture_selections(data: str | None, seq: int, preset: str) -> list[torch.Tensor]:
    """Every DSA layer's selection [T, W] (int32, on the model's device) for one real window."""
    from bench_memory_ablation import Bench

    from genolong.model.indexer import Indexer

    bench = Bench(preset=preset, data=data)
    found = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: found.append(out[0].detach()))
             for m in bench.model.modules() if isinstance(m, Indexer)]
    tokens = bench.window(seq)[:, :-1]
    with torch.no_grad():
        bench.model(tokens)
    for h in hooks:
        h.remove()
    return found


def random_selection(seq: int) -> torch.Tensor:
    from bench_sparse_attention import selection

    return selection(seq)[0]


def minhash_order(idx: torch.Tensor, hashes: int = 2) -> torch.Tensor:
    """A permutation of the rows that puts rows with similar selections side by side: sorted by
    `hashes` min-hashes of their key sets (two rows share a min-hash with probability equal to
    their Jaccard similarity)."""
    p = 2_147_483_629  # a prime below 2^31
    gen = torch.Generator().manual_seed(0)
    order = torch.arange(idx.shape[0], device=idx.device)
    keys = idx.long()
    for _ in range(hashes):
        a, b = (int(x) for x in torch.randint(1, p, (2,), generator=gen))
        h = torch.where(keys >= 0, (keys * a + b) % p, p).amin(1)
        order = order[torch.sort(h[order], stable=True).indices]
    return order


def overlap_rows(name: str, idx: torch.Tensor) -> list[dict]:
    rows = []
    quarter = idx.shape[0] // 4
    late = idx[-quarter:]
    mixed = late[minhash_order(late)]
    for g in GROUPS:
        whole = overlap(idx, g)
        # Early queries see few pools (their selections are nearly all of them): the last
        # quarter is the fair figure for long sequences; "minhash": its rows grouped by
        # similar selections instead of by position.
        rows.append(dict(phase="overlap", selection=name, group=g, ratio=round(whole["ratio"], 3),
                         ratio_last_quarter=round(overlap(late, g)["ratio"], 3),
                         ratio_last_quarter_minhash=round(overlap(mixed, g)["ratio"], 3), pairs=whole["pairs"]))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    p.add_argument("--seq", default="128k")
    p.add_argument("--preset", default="glm53-mini")
    p.add_argument("--out", default="runs/overlap")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seq = parse_length(args.seq)
    log = open(out / "overlap.jsonl", "a")

    def record(row):
        row = dict(seq=seq, **row)
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    t0 = time.perf_counter()
    selections = capture_selections(args.data, seq, args.preset)
    record(dict(phase="capture", layers=len(selections), width=selections[0].shape[1], s=round(time.perf_counter() - t0, 1)))
    for i, idx in enumerate(selections):
        for row in overlap_rows(f"real layer {i}", idx):
            record(row)
    for row in (overlap_rows("random inputs", random_selection(seq)) if torch.cuda.is_available() else []):
        record(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
