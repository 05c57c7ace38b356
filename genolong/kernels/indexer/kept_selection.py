"""The kept selection's pack check and expansion in one pass each (genolong/model/kept_selection.py, fused).

`pack_selection` keeps a [T, W] selection row as its pool indices plus the tail when every group of
kpool slots is one whole pool in ascending order. In PyTorch that is a strided division, then per
64k rows an expansion (a multiply, an add, a masked fill), a comparison and an any, then two
contiguous copies; `unpack_selection` expands again (multiply, add, masked fill) and concatenates.
Each of those passes reads or writes the 1 GiB selection of a 128k layer: ~80 ms of a 128k
glm53-mini step (profile of 2026-12-03: masked_fill 27.7 ms, int add 24.1, cat 15.9, copies).
Here one program per row reads the row once and writes its pools, its tail and whether it differs
from their expansion (one int32 flag for the launch, raised with an atomic max); the expansion is
one program per row writing the whole row. Integer arithmetic only: the same tensors as the
PyTorch form (tests/kernels/test_kept_selection_triton.py, in the interpreter).

The default on CUDA (`GENOLONG_KEPT_SELECTION=torch` keeps the PyTorch passes): equal to them on the
H200 (tests/gpu/test_selection_passes.py); with the fused row bounds a 128k step ran 6.25 s against
6.35 s, each of four counted steps faster (H200, 2026-12-03). Before the step's host syncs were
removed the 142 ms of GPU time they save did not show in the wall clock (7.54 vs 7.20 s).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from genolong import switches

ENV = "GENOLONG_KEPT_SELECTION"


def enabled(t: torch.Tensor, kpool: int) -> bool:
    """Whether the fused passes take this selection: int32 on CUDA (or in Triton's interpreter), a
    power-of-two pool size, and not turned off (GENOLONG_KEPT_SELECTION=torch)."""
    setting = switches.get(ENV)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (setting == "triton" and t.dtype == torch.int32 and (t.is_cuda or interpreted)
            and kpool >= 2 and kpool & (kpool - 1) == 0)


@triton.jit(do_not_specialize=["width", "topk", "tail_width"])
def _kept_selection_pack_kernel(idx_ptr, pools_ptr, tail_ptr, flag_ptr, width, topk, tail_width,
                 KPOOL: tl.constexpr, TOPK_B: tl.constexpr, TAIL_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, TOPK_B)
    i = tl.arange(0, KPOOL)
    live = p < topk
    base = idx_ptr + row * width
    body = tl.load(base + p[:, None] * KPOOL + i[None, :], mask=live[:, None], other=-1)
    first = tl.load(base + p * KPOOL, mask=live, other=-1)
    # A group is whole when its slots are pool*kpool + 0..kpool-1, or all -1 (pool -1).
    pool = tl.where(first < 0, -1, first // KPOOL)
    expected = tl.where(pool[:, None] < 0, -1, pool[:, None] * KPOOL + i[None, :])
    differs = tl.max(tl.max((expected != body).to(tl.int32), 1), 0)
    tl.atomic_max(flag_ptr, differs, sem="relaxed")
    tl.store(pools_ptr + row * topk + p, pool, mask=live)
    t = tl.arange(0, TAIL_B)
    tail = tl.load(base + topk * KPOOL + t, mask=t < tail_width, other=-1)
    tl.store(tail_ptr + row * tail_width + t, tail, mask=t < tail_width)


@triton.jit(do_not_specialize=["width", "topk", "tail_width"])
def _kept_selection_expand_kernel(pools_ptr, tail_ptr, out_ptr, width, topk, tail_width,
                   KPOOL: tl.constexpr, TOPK_B: tl.constexpr, TAIL_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, TOPK_B)
    i = tl.arange(0, KPOOL)
    live = p < topk
    pool = tl.load(pools_ptr + row * topk + p, mask=live, other=-1)
    tokens = tl.where(pool[:, None] < 0, -1, pool[:, None] * KPOOL + i[None, :])
    base = out_ptr + row * width
    tl.store(base + p[:, None] * KPOOL + i[None, :], tokens, mask=live[:, None])
    t = tl.arange(0, TAIL_B)
    tail = tl.load(tail_ptr + row * tail_width + t, mask=t < tail_width, other=-1)
    tl.store(base + topk * KPOOL + t, tail, mask=t < tail_width)


def _blocks(topk: int, tail_width: int) -> dict:
    return dict(TOPK_B=triton.next_power_of_2(max(topk, 1)), TAIL_B=triton.next_power_of_2(max(tail_width, 1)))


def pack(idx: torch.Tensor, *, kpool: int, topk_pools: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pools [..., topk_pools], tail [..., W - topk_pools * kpool], a 0-d bool tensor: does some group
    differ from its pool's expansion, i.e. the selection does not pack). idx [..., W] int32."""
    width = idx.shape[-1]
    rows = idx.reshape(idx.numel() // max(width, 1), width).contiguous()
    tail_width = width - topk_pools * kpool
    pools = torch.empty((rows.shape[0], topk_pools), dtype=idx.dtype, device=idx.device)
    tail = torch.empty((rows.shape[0], tail_width), dtype=idx.dtype, device=idx.device)
    flag = torch.zeros((), dtype=torch.int32, device=idx.device)
    if rows.shape[0]:
        _kept_selection_pack_kernel[(rows.shape[0],)](rows, pools, tail, flag, width, topk_pools, tail_width, KPOOL=kpool,
                                       **_blocks(topk_pools, tail_width), num_warps=4)
    lead = idx.shape[:-1]
    return pools.view(*lead, topk_pools), tail.view(*lead, tail_width), flag.bool()


def expand(pools: torch.Tensor, tail: torch.Tensor, *, kpool: int) -> torch.Tensor:
    """The selection [..., topk * kpool + tail width] whose pools and tail `pack` kept."""
    topk, tail_width = pools.shape[-1], tail.shape[-1]
    width = topk * kpool + tail_width
    n = pools.numel() // max(topk, 1)
    p, t = pools.reshape(n, topk).contiguous(), tail.reshape(n, tail_width).contiguous()  # n, not -1: a tail may be empty
    out = torch.empty((n, width), dtype=pools.dtype, device=pools.device)
    if p.shape[0]:
        _kept_selection_expand_kernel[(p.shape[0],)](p, t, out, width, topk, tail_width, KPOOL=kpool, **_blocks(topk, tail_width), num_warps=4)
    return out.view(*pools.shape[:-1], width)
