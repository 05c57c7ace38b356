"""What the sparse backward's dkv adds alone cost: the fp32 rows added for every (query, key) pair of a
real selection, in the order the key-chunked backward adds them, with nothing else in the kernel.

The twelfth session's probes put the key-chunked backward's dkv part at ~112 ms of 275 at 128k x 4
heads, with plain stores no faster than the adds (benchmarks/RESULTS.md): 128k x 2,051 pairs x 2 KiB
is 550 GB, ~4.9 TB/s. Whether that is the memory system's ceiling for 2 KiB rows scattered over a key
chunk's 32 MiB (then no kernel change to the adds can pay, and the 4-head op cannot reach issue 12's
3x) or the kernel's own overhead (the layout change through shared memory, instruction issue: then
the adds in the products' layout, GENOLONG_SPARSE_MLA_ADDS=layout, can) is what this probe answers:
one Triton program per run of blocks of BN pairs, each block adding a [BN, D] fp32 block

- `values`: "mma" (the block comes out of a tensor-core product, as the backward's dkv block does, so
  tl.atomic_add first changes its layout through shared memory) or "flat" (a broadcast constant, no
  layout change: the adds alone);
- `mode`: "coalesced" (tl.atomic_add: the backward's default), "layout" (red.global.add.v2.f32 from the
  values' own layout: sparse_mla_triton._red_add_pairs), "store" (plain stores: the bytes without the
  reduction);
- `order`: "keychunk" (pairs grouped by key chunk, then query, then slot: the key-chunked backward's
  order) or "query" (row by row: the one-pass backward's order, adds to random rows of the whole buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from genolong.kernels.sparse_mla_triton import _red_add_pairs

MODES = {"coalesced": 0, "layout": 1, "store": 2}
VALUES = ("mma", "flat")
ORDERS = ("keychunk", "query")


def pair_keys(idx: torch.Tensor, order: str, key_chunk: int) -> torch.Tensor:
    """The keys of every valid (query, slot) pair of `idx` [B, T, W] (-1 = empty), int32, in `order`."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    keys = idx.reshape(-1)
    keys = keys[keys >= 0]
    if order == "keychunk":  # stable: within a chunk, queries and their slots stay in order
        keys = keys[torch.argsort(torch.div(keys, key_chunk, rounding_mode="floor"), stable=True)]
    return keys.to(torch.int32).contiguous()


@triton.jit
def _dkv_adds_kernel(keys_ptr, dkv_ptr, n_pairs, D: tl.constexpr, BN: tl.constexpr, BLOCKS: tl.constexpr,
                     MODE: tl.constexpr, MMA: tl.constexpr):
    d = tl.arange(0, D)
    if MMA:
        # ones [BN, 16] x ones [16, D] = 16.0: the block a tensor-core product leaves in its registers.
        values = tl.dot(tl.full([BN, 16], 1.0, tl.float16), tl.full([16, D], 1.0, tl.float16))
    else:
        values = tl.full([BN, D], 16.0, tl.float32)
    first = tl.program_id(0).to(tl.int64) * BLOCKS * BN
    for b in range(BLOCKS):
        pair = first + b * BN + tl.arange(0, BN)
        key = tl.load(keys_ptr + pair, mask=pair < n_pairs, other=-1)
        live = (key >= 0)[:, None] & (d[None, :] < D)
        dst = dkv_ptr + key.to(tl.int64)[:, None] * D + d[None, :]
        if MODE == 0:
            tl.atomic_add(dst, values, mask=live, sem="relaxed")
        elif MODE == 1:
            _red_add_pairs(dst, values, live)
        else:
            tl.store(dst, values, mask=live)


def dkv_adds(keys: torch.Tensor, dkv: torch.Tensor, *, mode: str = "coalesced", values: str = "mma",
             block_n: int = 16, blocks: int = 16, num_warps: int = 4) -> None:
    """dkv[k] += 16.0 for every key k in `keys` (mode "store": dkv[k] = 16.0), dkv [S, D] fp32."""
    if mode not in MODES or values not in VALUES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} and values one of {', '.join(VALUES)}; got {mode!r}, {values!r}")
    if dkv.dtype != torch.float32 or not dkv.is_contiguous():
        raise ValueError("dkv must be a contiguous fp32 [S, D] buffer")
    n = keys.numel()
    grid = (triton.cdiv(n, block_n * blocks),)
    _dkv_adds_kernel[grid](keys, dkv, n, D=dkv.shape[1], BN=block_n, BLOCKS=blocks, MODE=MODES[mode], MMA=values == "mma",
                           num_warps=num_warps)
