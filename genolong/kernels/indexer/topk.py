"""The DSA indexer's pool scoring and top-k: query-chunked, memory-budgeted, and fused on the GPU.

score(t, p) = sum_h w[t,h] * relu(scale * q[t,h].K[p]) over the pools p that have ended by t
(docs/ops.md). Two implementations, both chunked over queries with the chunk sized from a byte
budget, so the transient memory does not grow with the sequence:

- `chunked`: plain PyTorch, one head at a time into one [chunk, pools] fp32 score block, then
  torch.topk. Runs anywhere; the GPU benchmark's baseline is its unbudgeted cousin.
- `fused` (Triton): never writes a score row. Pass 1 computes the scores tile by tile (tiles
  above the causal diagonal are skipped) and keeps only the maximum of each group of G
  consecutive pools, [chunk, pools / G]. The top `topk` pools all lie in the top `topk` groups
  by that maximum: a pool outside them is beaten by the maxima of `topk` other groups, that is
  by `topk` other pools. So pass 2 rescores only the G * topk candidate pools of those groups
  (gathered keys, exact fp32 scores) and takes the final top-k from them. The selection equals
  the full top-k except between scores equal to within fp32 rounding (order is unspecified
  among ties, as in the reference).
- `fused_select` (Triton, v2, registered first): the same two passes and the same argument, with
  pass 1 computing one product per head (no head stacking) and also keeping the maximum of each
  super-group of SUPER = 8 consecutive groups; the top `topk` groups lie in the top `topk`
  super-groups (the same argument one level up), so a selection kernel picks those, then the
  top `topk` groups among their 8 * topk groups; pass 2 rescores the candidates and chooses the
  final top-k itself. Every selection is an exact bitwise search for the k-th largest value in
  registers: no `torch.topk` at all, and pass 2 writes the token indices and the tail directly
  (no candidate-score buffer, no expansion pass over memory). `two_pass` stays selectable.

Queries may be a piece of a sequence (`query_offset`, docs/ops.md): the queries are at positions
query_offset + [0, T), the pools cover the sequence from 0, indices are global positions.

Both return the op's output: int32 [B, T, topk_pools * kpool (+ kpool - 1 tail)], -1 unused.
"""

from __future__ import annotations

import torch

from genolong.kernels import _common
from genolong.model.ops import KernelUnsupported

GROUP = 8
# Pools per group of the v2 path (fused_select). The group maxima are exact bounds for any G, so
# G changes the cost, never the selection: fewer pools per group halve pass 2's gathered
# candidates (G * topk per query) for twice the group maxima. Measured at 512k on the H200
# (bench_indexer.py, 2026-12-02, side by side): G=4 242.3 ms, G=8 351.5 ms, the same selections.
V2_GROUP = 4
BUDGET_BYTES = 2 << 30
MIN_CHUNK = 64


def out_width(kpool: int, topk_pools: int, always_select_tail: bool) -> int:
    return topk_pools * kpool + (kpool - 1 if always_select_tail else 0)


def expand_pools(pools: torch.Tensor, t: torch.Tensor, *, kpool: int, topk_pools: int, always_select_tail: bool) -> torch.Tensor:
    """Selected pool ids [n, k] (-1 = none) of queries t [n] -> int32 token indices [n, W]."""
    n, k = pools.shape
    out = torch.full((n, out_width(kpool, topk_pools, always_select_tail)), -1, dtype=torch.int32, device=pools.device)
    in_pool = torch.arange(kpool, device=pools.device)
    tokens = pools.unsqueeze(-1) * kpool + in_pool
    tokens = tokens.masked_fill((pools < 0).unsqueeze(-1), -1)
    out[:, : k * kpool] = tokens.flatten(1).to(torch.int32)
    if always_select_tail and kpool > 1:
        n_tail = (t + 1) % kpool
        tail = (t + 1 - n_tail)[:, None] + in_pool[:-1]
        out[:, topk_pools * kpool :] = tail.masked_fill(in_pool[:-1] >= n_tail[:, None], -1).to(torch.int32)
    return out


def selectable(pools: torch.Tensor, t: torch.Tensor, kpool: int) -> torch.Tensor:
    """Pool p is selectable by query t iff its last token (p + 1) * kpool - 1 is at or before t."""
    return (pools + 1) * kpool <= t + 1


# ----------------------------------------------------------------------------- plain PyTorch


def chunk_rows(bytes_per_row: int, budget_bytes: int) -> int:
    return max(MIN_CHUNK, budget_bytes // max(1, bytes_per_row) // MIN_CHUNK * MIN_CHUNK)


def scores_torch(q, keys, w, t, *, kpool: int, scale: float) -> torch.Tensor:
    """[n, P] fp32 (fp64 for fp64 inputs) scores of queries t against pools 0..P-1, -inf where not selectable."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    keys_t = keys.to(dtype).t()
    scores = torch.zeros(q.shape[0], keys.shape[0], dtype=dtype, device=q.device)
    for h in range(q.shape[1]):
        scores += w[:, h, None].to(dtype) * torch.relu(q[:, h].to(dtype) @ keys_t * scale)
    visible = selectable(torch.arange(keys.shape[0], device=q.device)[None, :], t[:, None], kpool)
    return scores.masked_fill(~visible, float("-inf"))


def _top_pools(scores: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, scores.shape[1])
    if k == 0:
        return torch.full((scores.shape[0], 0), -1, dtype=torch.long, device=scores.device)
    top = scores.topk(k, dim=-1)
    return top.indices.masked_fill(top.values == float("-inf"), -1)


def query_chunks(seq: int, rows: int, query_offset: int, n_pools: int, kpool: int, device):
    """(local start, local end, global positions, pools visible to the chunk's last query) per chunk."""
    for t0 in range(0, seq, rows):
        t1 = min(seq, t0 + rows)
        t = _common.positions(query_offset + t0, t1 - t0, device)
        yield t0, t1, t, min(n_pools, (query_offset + t1) // kpool)


def indexer_chunked(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale,
                    query_offset=0, budget_bytes=BUDGET_BYTES):
    batch, seq, heads, _ = index_q.shape
    n_pools = pool_keys.shape[1]
    width = out_width(kpool, topk_pools, always_select_tail)
    out = _common.empty((batch, seq, width), dtype=torch.int32, device=index_q.device)
    # Score block + one head's product + topk's copy, all fp32, plus the int outputs.
    rows = chunk_rows(n_pools * 12 + topk_pools * 12 + width * 8, budget_bytes)
    for b in range(batch):
        for t0, t1, t, visible in query_chunks(seq, rows, query_offset, n_pools, kpool, index_q.device):
            scores = scores_torch(index_q[b, t0:t1], pool_keys[b, :visible], head_weights[b, t0:t1], t, kpool=kpool, scale=softmax_scale)
            pools = _top_pools(scores, topk_pools)
            out[b, t0:t1] = expand_pools(pools, t, kpool=kpool, topk_pools=topk_pools, always_select_tail=always_select_tail)
    return out


# ----------------------------------------------------------------------------- two-pass selection


def group_max_torch(q, keys, w, t, *, kpool: int, scale: float, group: int) -> torch.Tensor:
    """Pass 1 in PyTorch (the CPU stand-in for the Triton kernel): [n, ceil(P / G)] group maxima."""
    scores = scores_torch(q, keys, w, t, kpool=kpool, scale=scale)
    pad = (-scores.shape[1]) % group
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(scores.shape[0], -1, group).amax(-1)


def candidate_scores_torch(q, keys, w, t, gidx, gval, *, kpool: int, scale: float, group: int) -> torch.Tensor:
    """Pass 2 in PyTorch: exact scores of the pools of the chosen groups, [n, k * G], -inf if invalid."""
    pools = (gidx.unsqueeze(-1) * group + torch.arange(group, device=q.device)).flatten(1)
    ok = (gval > float("-inf")).repeat_interleave(group, 1) & (pools < keys.shape[0]) & selectable(pools, t[:, None], kpool)
    k = keys.float()[pools.clamp(max=keys.shape[0] - 1)]  # [n, kG, D]
    s = torch.einsum("nhd,ncd->nhc", q.float(), k) * scale
    s = (torch.relu(s) * w.float().unsqueeze(-1)).sum(1)
    return s.masked_fill(~ok, float("-inf"))


def select_two_pass(q, keys, w, t, *, kpool, topk_pools, scale, group, group_max, candidate_scores, sorted_topk=False):
    """Top pools [n, topk] (-1 = none) of queries t through group maxima and candidate rescoring.

    The selection is a set (attention does not depend on the order of its keys), so both top-k
    calls skip sorting their results unless `sorted_topk` (kept for the benchmark's comparison)."""
    if keys.shape[0] == 0:
        return torch.full((q.shape[0], 0), -1, dtype=torch.long, device=q.device)
    gmax = group_max(q, keys, w, t, kpool=kpool, scale=scale, group=group)
    kg = min(topk_pools, gmax.shape[1])
    if kg == 0:
        return torch.full((q.shape[0], 0), -1, dtype=torch.long, device=q.device)
    top_groups = gmax.topk(kg, dim=-1, sorted=sorted_topk)
    cand = candidate_scores(q, keys, w, t, top_groups.indices, top_groups.values, kpool=kpool, scale=scale, group=group)
    top = cand.topk(min(topk_pools, cand.shape[1]), dim=-1, sorted=sorted_topk)
    pools = top_groups.indices.gather(1, top.indices // group) * group + top.indices % group
    return pools.masked_fill(top.values == float("-inf"), -1)


def indexer_two_pass(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale,
                     query_offset=0, group=GROUP, budget_bytes=BUDGET_BYTES, group_max=group_max_torch,
                     candidate_scores=candidate_scores_torch, sorted_topk=False):
    batch, seq, heads, _ = index_q.shape
    n_pools = pool_keys.shape[1]
    width = out_width(kpool, topk_pools, always_select_tail)
    out = _common.empty((batch, seq, width), dtype=torch.int32, device=index_q.device)
    n_groups = -(-n_pools // group)
    # Group maxima and topk's copy of them, candidate scores, top-k values/indices, outputs.
    rows = chunk_rows(n_groups * 8 + topk_pools * (group * 4 + 24) + width * 8, budget_bytes)
    for b in range(batch):
        for t0, t1, t, visible in query_chunks(seq, rows, query_offset, n_pools, kpool, index_q.device):
            pools = select_two_pass(index_q[b, t0:t1], pool_keys[b, :visible], head_weights[b, t0:t1], t, kpool=kpool,
                                    topk_pools=topk_pools, scale=softmax_scale, group=group,
                                    group_max=group_max, candidate_scores=candidate_scores, sorted_topk=sorted_topk)
            out[b, t0:t1] = expand_pools(pools, t, kpool=kpool, topk_pools=topk_pools, always_select_tail=always_select_tail)
    return out


# ----------------------------------------------------------------------------- v2: selection inside pass 2


def select_groups_torch(gmax: torch.Tensor, topk_pools: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top groups by their maxima (the CPU stand-in for the group selection): (ids, maxima)."""
    top = gmax.topk(min(topk_pools, gmax.shape[1]), dim=-1, sorted=False)
    return top.indices, top.values


def group_max_super_torch(q, keys, w, t, *, kpool: int, scale: float, group: int, sup: int = 8):
    """Pass 1 v2 in PyTorch: (group maxima, maxima of `sup` consecutive groups)."""
    gmax = group_max_torch(q, keys, w, t, kpool=kpool, scale=scale, group=group)
    pad = (-gmax.shape[1]) % sup
    return gmax, torch.nn.functional.pad(gmax, (0, pad), value=float("-inf")).view(gmax.shape[0], -1, sup).amax(-1), sup


def select_groups_super_torch(maxima, topk_pools: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group selection kernel's two levels in PyTorch: top super-groups, then the top groups in them."""
    gmax, sg, sup = maxima
    top_sg = sg.topk(min(topk_pools, sg.shape[1]), dim=-1, sorted=False)
    gid = (top_sg.indices.unsqueeze(-1) * sup + torch.arange(sup, device=gmax.device)).flatten(1)
    ok = (top_sg.values > float("-inf")).repeat_interleave(sup, 1) & (gid < gmax.shape[1])
    vals = gmax.gather(1, gid.clamp(max=gmax.shape[1] - 1)).masked_fill(~ok, float("-inf"))
    top = vals.topk(min(topk_pools, vals.shape[1]), dim=-1, sorted=False)
    return gid.gather(1, top.indices), top.values


def select_candidates_torch(q, keys, w, t, gidx, gval, out, *, kpool, scale, group, topk_pools, always_select_tail):
    """Pass 2 v2 in PyTorch (the CPU stand-in for the Triton kernel): fills `out` [n, W] for queries t."""
    cand = candidate_scores_torch(q, keys, w, t, gidx, gval, kpool=kpool, scale=scale, group=group)
    top = cand.topk(min(topk_pools, cand.shape[1]), dim=-1, sorted=False)
    pools = (gidx.gather(1, top.indices // group) * group + top.indices % group).masked_fill(top.values == float("-inf"), -1)
    out.copy_(expand_pools(pools, t, kpool=kpool, topk_pools=topk_pools, always_select_tail=always_select_tail))


def indexer_fused_select(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale,
                         query_offset=0, group=GROUP, budget_bytes=BUDGET_BYTES, group_max=group_max_torch,
                         select_groups=select_groups_torch, select=select_candidates_torch):
    """Pass 1 (`group_max`), the top groups (`select_groups`), then `select` rescores their pools and writes the rows."""
    batch, seq, heads, _ = index_q.shape
    n_pools = pool_keys.shape[1]
    width = out_width(kpool, topk_pools, always_select_tail)
    out = _common.empty((batch, seq, width), dtype=torch.int32, device=index_q.device)
    n_groups = -(-n_pools // group)
    # Group maxima (and a top-k's copy of them), top groups, the candidate-score scratch.
    rows = chunk_rows(n_groups * 8 + topk_pools * (group * 4 + 16), budget_bytes)
    kw = dict(kpool=kpool, topk_pools=topk_pools, always_select_tail=always_select_tail)
    for b in range(batch):
        for t0, t1, t, visible in query_chunks(seq, rows, query_offset, n_pools, kpool, index_q.device):
            q, keys, w = index_q[b, t0:t1], pool_keys[b, :visible], head_weights[b, t0:t1]
            if visible == 0 or topk_pools == 0:
                none = torch.full((t1 - t0, 0), -1, dtype=torch.long, device=index_q.device)
                out[b, t0:t1] = expand_pools(none, t, **kw)
                continue
            maxima = group_max(q, keys, w, t, kpool=kpool, scale=softmax_scale, group=group)
            gidx, gval = select_groups(maxima, topk_pools)
            select(q, keys, w, t, gidx, gval, out[b, t0:t1], scale=softmax_scale, group=group, **kw)
    return out


# ----------------------------------------------------------------------------- op entry points


def _check(index_q, pool_keys, head_weights):
    _common.require_cuda(index_q, pool_keys, head_weights)
    if index_q.ndim != 4 or pool_keys.ndim != 3 or head_weights.ndim != 3:
        raise KernelUnsupported(f"expects index_q [B,T,H,D], pool_keys [B,P,D], head_weights [B,T,H]; got {index_q.shape}, {pool_keys.shape}, {head_weights.shape}")


def _triton():
    try:
        from genolong.kernels.indexer import triton_kernels as indexer_triton
    except ImportError as why:
        raise KernelUnsupported(f"triton is not importable: {why}") from why
    return indexer_triton


def dsa_indexer_topk_fused_select(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale,
                                  query_offset=0):
    """The "dsa_indexer_topk" op through the v2 Triton passes (selection inside pass 2)."""
    _check(index_q, pool_keys, head_weights)
    triton_mod = _triton()
    triton_mod.check_supported(index_q, pool_keys)
    group = V2_GROUP
    triton_mod.check_supported_v2(kpool, topk_pools, group, pool_keys.shape[1])
    return indexer_fused_select(index_q, pool_keys, head_weights, kpool=kpool, topk_pools=topk_pools, group=group,
                                always_select_tail=always_select_tail, softmax_scale=softmax_scale, query_offset=query_offset,
                                group_max=triton_mod.group_max_v2, select_groups=triton_mod.select_groups,
                                select=triton_mod.select_candidates)


def dsa_indexer_topk_fused(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale,
                           query_offset=0):
    """The "dsa_indexer_topk" op through the v1 Triton passes (two torch.topk calls)."""
    _check(index_q, pool_keys, head_weights)
    triton_mod = _triton()
    triton_mod.check_supported(index_q, pool_keys)
    return indexer_two_pass(index_q, pool_keys, head_weights, kpool=kpool, topk_pools=topk_pools,
                            always_select_tail=always_select_tail, softmax_scale=softmax_scale, query_offset=query_offset,
                            group_max=triton_mod.group_max, candidate_scores=triton_mod.candidate_scores)


def dsa_indexer_topk_chunked(index_q, pool_keys, head_weights, *, kpool, topk_pools, always_select_tail, softmax_scale,
                             query_offset=0):
    """The "dsa_indexer_topk" op in plain PyTorch, memory-budgeted (the GPU's last resort before the reference)."""
    _check(index_q, pool_keys, head_weights)
    return indexer_chunked(index_q, pool_keys, head_weights, kpool=kpool, topk_pools=topk_pools,
                           always_select_tail=always_select_tail, softmax_scale=softmax_scale, query_offset=query_offset)
