"""The key-chunked sparse backward's row bounds in one pass (sparse_mla.key_chunk_rows, fused).

For rows that ascend apart from their empty slots (the fused indexers write them so), the chunk
ranges come from each slot's smallest key at or after it (the suffix minimum, which ascends): row
r's slots of key chunk c are [bounds[r, c], bounds[r, c + 1]) with bounds[r, c] the number of slots
whose suffix minimum is below edges[c]. The PyTorch form takes a where, two flips, a cummin (int32
values and int64 positions), the comparison, an all and a searchsorted: seven passes over the
[rows, W] selection, ~70 ms of a 128k glm53-mini step (profile of 2026-12-03). Here one program
per row loads the row once, scans it in registers and writes its C + 1 bounds and whether it
ascends (one int32 flag for the launch, lowered with an atomic min). Integer arithmetic only: the
result equals the PyTorch form's exactly (tests/kernels/test_chunk_bounds.py, in the interpreter;
tests/gpu/test_selection_passes.py on the H200; the PyTorch form is
sparse_mla.ascending_bounds_reference). With the fused kept selection a 128k step ran 6.25 s against
6.35 s with the PyTorch passes (each of four counted steps faster; H200, 2026-12-03).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit(do_not_specialize=["width", "n_bounds"])
def _chunk_bounds_kernel(idx_ptr, edges_ptr, bounds_ptr, flag_ptr, width, n_bounds, BW: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BW)
    j = tl.load(idx_ptr + row * width + slot, mask=slot < width, other=-1)
    # Empty slots (negative, and the padding past W) count as +inf: they join the next key's range.
    filled = tl.where(j >= 0, j, INT32_MAX)
    suffix_min = tl.associative_scan(filled, 0, _min_combine, reverse=True)
    ascends = tl.min(((j < 0) | (j == suffix_min)).to(tl.int32), 0)
    tl.atomic_min(flag_ptr, ascends, sem="relaxed")
    # NB (a power of two >= n_bounds) as the trip count: one build per power of two of chunks.
    for c in range(0, NB):
        if c < n_bounds:
            edge = tl.load(edges_ptr + c)
            tl.store(bounds_ptr + row * n_bounds + c, tl.sum((suffix_min < edge).to(tl.int32), 0))


def ascending_bounds(idx: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds [n, C + 1] int32 as `key_chunk_rows` finds them for rows walked as they are, a 0-d
    bool tensor: do all rows ascend apart from their empty slots). idx [n, W] int32, edges [C + 1]
    int32 ascending, both contiguous on one device."""
    rows, width = idx.shape
    bounds = torch.empty((rows, edges.numel()), dtype=torch.int32, device=idx.device)
    flag = torch.ones((), dtype=torch.int32, device=idx.device)
    if rows:
        block = triton.next_power_of_2(width)
        _chunk_bounds_kernel[(rows,)](idx, edges, bounds, flag, width, edges.numel(), BW=block,
                                          NB=triton.next_power_of_2(edges.numel()),
                                          num_warps=4 if block <= 2048 else 8)
    return bounds, flag.bool()
