"""The grouped few-head sparse MLA passes: key chunk by key chunk, consecutive queries stacked.

Host side of sparse_mla_grouped_triton.py (the design is in its docstring and docs/kernels.md).
Per chunk of queries (sized from a byte budget, and within one batch element):

1. pack: the selections of each group of `query_group` consecutive queries become one row of
   key * QG + (query within the group) (-1 for an empty slot or a key outside [0, S)), sorted, so
   that a group's slots in key chunk c are the range [bounds[g, c], bounds[g, c+1]);
2. one kernel launch per key chunk, in key order, over the groups that have slots in it (found
   with one device-to-host copy of a [3, C] summary per query chunk);
3. the forward turns its fp32 state into out and the natural-log lse; the backward's fp32 dq
   becomes q's dtype.

sparse_mla.py picks these passes by mode ("grouped") and chooses their launch configurations.
"""

from __future__ import annotations

import math

import torch

from genolong.model.ops import KernelUnsupported

LN2 = math.log(2.0)


def pack(idx: torch.Tensor, query_group: int, seq_kv: int, key_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [G, QG*W] int32 sorted per group, bounds [G, C+1] int32) for idx [n, W]."""
    n, width = idx.shape
    n_chunks = max(1, math.ceil(seq_kv / key_chunk))
    if (n_chunks * key_chunk + 1) * query_group >= 2**31:
        raise KernelUnsupported(f"{seq_kv} keys in chunks of {key_chunk} x {query_group} queries per group overflow int32 packing")
    groups = -(-n // query_group)
    if groups * query_group != n:
        idx = torch.cat([idx, idx.new_full((groups * query_group - n, width), -1)])
    member = (torch.arange(groups * query_group, device=idx.device, dtype=torch.int32) % query_group)[:, None]
    packed = torch.where((idx >= 0) & (idx < seq_kv), idx.clamp(min=0) * query_group + member, -1)
    packed = torch.sort(packed.view(groups, query_group * width), dim=-1).values
    edges = torch.arange(n_chunks + 1, device=idx.device, dtype=torch.int32) * (key_chunk * query_group)
    bounds = torch.searchsorted(packed, edges.expand(groups, -1).contiguous(), out_int32=True)
    return packed, bounds


def group_spans(bounds: torch.Tensor) -> list[tuple[int, int]]:
    """Per key chunk, the groups [g0, g1) from the first to the last that have a slot in it."""
    busy = bounds[:, 1:] > bounds[:, :-1]  # [G, C]
    groups = busy.shape[0]
    first = busy.int().argmax(0)
    last = groups - 1 - busy.flip(0).int().argmax(0)
    summary = torch.stack([busy.any(0).int(), first, last]).tolist()
    return [(f, l + 1) if any_ else (0, 0) for any_, f, l in zip(*summary)]


def row_bytes(width: int, heads: int, dim: int, n_chunks: int, query_group: int) -> int:
    """Transient bytes per query of a query chunk: packing and sorting (the packed row, its sorted
    copy, the sort's int64 positions and its own double buffers), the bounds, and the fp32 state or dq."""
    return width * 32 + (n_chunks + 1) * 8 // query_group + 8 + heads * (dim + 2) * 4


def rows_per_chunk(width: int, heads: int, dim: int, n_chunks: int, query_group: int, budget_bytes: int, align: int) -> int:
    rows = budget_bytes // row_bytes(width, heads, dim, n_chunks, query_group)
    return max(align, rows // align * align)


def forward(q, kv, idx, out, lse, *, scale: float, key_chunk: int, config) -> None:
    """out [n,H,D] and lse [n,H] (natural log, -inf for a row without keys) of n queries of one
    batch element, whose keys are kv [S, D]."""
    from genolong.kernels import sparse_mla_grouped_triton as k

    n, heads, dim = q.shape
    if n == 0:
        return
    packed, bounds = pack(idx, config.query_group, kv.shape[0], key_chunk)
    acc = torch.zeros((n, heads, dim), dtype=torch.float32, device=q.device)
    m = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device)
    l = torch.zeros((n, heads), dtype=torch.float32, device=q.device)
    for chunk, groups in enumerate(group_spans(bounds)):
        k.forward_chunk(q, kv, packed, bounds, acc, m, l, chunk=chunk, groups=groups, scale=scale, config=config)
    # l >= 1 wherever a key was seen (the maximum's own term) and 0 (with acc 0) where none was.
    out.copy_(acc.div_(l.clamp(min=1.0)[..., None]))
    lse.copy_(torch.where(l > 0, (m + torch.log2(l.clamp(min=1.0))) * LN2, float("-inf")))


def backward(q, kv, idx, dout, lse, dlt, dq, dkv, *, scale: float, key_chunk: int, config, add_dkv: bool = True) -> None:
    """dq [n,H,D] (q's dtype, stored) and dkv (fp32 [S,D], added to) of n queries of one batch
    element, whose keys are kv [S, D]."""
    from genolong.kernels import sparse_mla_grouped_triton as k

    n, heads, dim = q.shape
    if n == 0:
        return
    packed, bounds = pack(idx, config.query_group, kv.shape[0], key_chunk)
    dq32 = torch.zeros((n, heads, dim), dtype=torch.float32, device=q.device)
    for chunk, groups in enumerate(group_spans(bounds)):
        k.backward_chunk(q, kv, packed, bounds, dout, lse, dlt, dq32, dkv, chunk=chunk, groups=groups, scale=scale,
                         config=config, add_dkv=add_dkv)
    dq.copy_(dq32)
