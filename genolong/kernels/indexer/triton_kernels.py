"""The Triton passes of the fused indexer (see indexer/topk.py for the algorithm).

Two generations live here side by side, so the benchmark can time them on the same input:

- v2 (registered first): `group_max_v2` and `select_candidates`, below the v1 kernels.
- v1: `group_max` and `candidate_scores`, described next.

Pass 1 (`group_max`): one program per block of BM queries and N_INNER blocks of BN pools. The
queries' heads are stacked into one [BM * HP, D] operand, so each pool block is one tensor-core
product; relu, the head weights and the head sum follow in registers, then the causal mask and
the maximum over each group of G pools. Pool blocks past the block's last visible pool are never
visited (their group maxima keep the -inf the buffer starts with).

Pass 2 (`candidate_scores`): one program per query; it gathers the keys of its candidate pools
(G per chosen group) in blocks of BC and scores them exactly like pass 1.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from genolong.kernels import _common, aot
from genolong.model.ops import KernelUnsupported

BM, BN, N_INNER = 64, 64, 16
BC = 128


def check_supported(index_q: torch.Tensor, pool_keys: torch.Tensor) -> None:
    dim = index_q.shape[-1]
    if dim not in (16, 32, 64, 128, 256) or pool_keys.shape[-1] != dim:
        raise KernelUnsupported(f"index head dim must be a power of two in [16, 256] matching the pool keys, got {dim} / {pool_keys.shape[-1]}")
    if index_q.dtype not in (torch.bfloat16, torch.float16) or pool_keys.dtype != index_q.dtype:
        raise KernelUnsupported(f"index_q and pool_keys must share a 16-bit dtype, got {index_q.dtype} / {pool_keys.dtype}")
    if index_q.shape[2] > 64:
        raise KernelUnsupported(f"at most 64 indexer heads, got {index_q.shape[2]}")


def check_supported_v2(kpool: int, topk_pools: int, group: int, n_pools: int) -> None:
    # Pass 2 v2 holds a query's G * topk candidate scores in registers and lays out kpool tokens
    # per pool with tl.arange, which needs powers of two.
    if kpool & (kpool - 1):
        raise KernelUnsupported(f"the v2 selection needs a power-of-two kpool, got {kpool}")
    if topk_pools * max(group, SUPER) > 16384:
        raise KernelUnsupported(f"the v2 selections hold at most 16384 candidates per query, got {topk_pools} x {max(group, SUPER)}")
    if -(-n_pools // (group * SUPER)) > MAX_SUPER_GROUPS:
        raise KernelUnsupported(f"the v2 group selection holds at most {MAX_SUPER_GROUPS} super-groups, {n_pools} pools make more")


@triton.jit
def _group_max_kernel(q_ptr, k_ptr, w_ptr, out_ptr, n_rows, t0, n_pools, n_groups, scale,
                      stride_qt, stride_qh, stride_kp, stride_wt, stride_ot,
                      KPOOL: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, N_INNER: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BM
    last_t = t0 + tl.minimum(row0 + BM, n_rows) - 1
    n_visible = tl.minimum((last_t + 1) // KPOOL, n_pools)
    blk0 = pid_n * N_INNER
    n_blocks = tl.cdiv(n_visible, BN)
    if blk0 < n_blocks:
        r = tl.arange(0, BM * HP)
        q_row = row0 + r // HP
        head = r % HP
        live = (q_row < n_rows) & (head < H)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + q_row[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)
        w = tl.load(w_ptr + q_row.to(tl.int64) * stride_wt + head, mask=live, other=0.0)
        rows = row0 + tl.arange(0, BM)
        t = t0 + rows
        for i in range(N_INNER):
            blk = blk0 + i
            if blk < n_blocks:
                p = blk * BN + tl.arange(0, BN)
                k = tl.load(k_ptr + p[:, None].to(tl.int64) * stride_kp + d[None, :], mask=(p < n_pools)[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k))
                s = tl.maximum(s * scale, 0.0) * w[:, None]
                s = tl.sum(tl.reshape(s, (BM, HP, BN)), axis=1)
                ok = ((p[None, :] + 1) * KPOOL <= t[:, None] + 1) & (p[None, :] < n_pools)
                s = tl.where(ok, s, float("-inf"))
                gm = tl.max(tl.reshape(s, (BM, BN // G, G)), axis=2)
                g = blk * (BN // G) + tl.arange(0, BN // G)
                tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + g[None, :], gm,
                         mask=(rows < n_rows)[:, None] & (g < n_groups)[None, :])


@triton.jit
def _score_candidates(q, w, k_ptr, gidx_row, gval_row, out_row, c, n_cand, n_pools, t, scale, stride_kp,
                      KPOOL: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """Exact scores of the candidate pools c of one query (pool G * gidx[c // G] + c % G), written
    to out_row[c]; -inf for candidates past n_cand, of an empty group or not yet visible at t."""
    cm = c < n_cand
    gi = tl.load(gidx_row + c // G, mask=cm, other=0)
    gv = tl.load(gval_row + c // G, mask=cm, other=float("-inf"))
    p = gi * G + c % G
    ok = cm & (gv > float("-inf")) & (p < n_pools) & ((p + 1) * KPOOL <= t + 1)
    k = tl.load(k_ptr + p[:, None] * stride_kp + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    sc = tl.sum(tl.maximum(tl.dot(q, tl.trans(k)) * scale, 0.0) * w[:, None], axis=0)
    tl.store(out_row + c, tl.where(ok, sc, float("-inf")), mask=cm)


@triton.jit
def _candidate_kernel(q_ptr, k_ptr, w_ptr, gidx_ptr, gval_ptr, out_ptr, t0, n_pools, n_cand, scale,
                      stride_qt, stride_qh, stride_kp, stride_wt, stride_gt, stride_ot,
                      KPOOL: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                      G: tl.constexpr, BC: tl.constexpr, N_BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = t0 + row
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :], mask=(h < H)[:, None], other=0.0)
    w = tl.load(w_ptr + row * stride_wt + h, mask=h < H, other=0.0)
    for i in range(N_BLOCKS):
        _score_candidates(q, w, k_ptr, gidx_ptr + row * stride_gt, gval_ptr + row * stride_gt, out_ptr + row * stride_ot,
                          i * BC + tl.arange(0, BC), n_cand, n_pools, t, scale, stride_kp, KPOOL=KPOOL, D=D, G=G)


def block_queries(heads_padded: int) -> int:
    """Queries per pass-1 program: the stacked operand has BM * HP = 256 rows (64 for HP < 4)."""
    return max(4, BM // max(1, heads_padded // 4))


def _heads_padded(heads: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(heads))


def group_max(q, keys, w, t, *, kpool: int, scale: float, group: int) -> torch.Tensor:
    """q [n,H,D], keys [P,D], w [n,H] fp32, queries t = t[0] + arange(n) -> [n, ceil(P/G)] fp32."""
    n, heads, dim = q.shape
    n_pools = keys.shape[0]
    n_groups = -(-n_pools // group)
    out = torch.full((n, n_groups), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0 or n_pools == 0:
        return out
    q, keys, w = q.contiguous(), keys.contiguous(), w.float().contiguous()
    hp = _heads_padded(heads, 1)
    bm = block_queries(hp)
    grid = (triton.cdiv(n, bm), triton.cdiv(triton.cdiv(n_pools, BN), N_INNER))
    _group_max_kernel[grid](q, keys, w, out, n, _common.first_position(t), n_pools, n_groups, float(scale),
                            q.stride(0), q.stride(1), keys.stride(0), w.stride(0), out.stride(0),
                            KPOOL=kpool, H=heads, HP=hp, D=dim, BM=bm, BN=BN, G=group,
                            N_INNER=N_INNER, num_warps=8, num_stages=2)
    return out


def candidate_scores(q, keys, w, t, gidx, gval, *, kpool: int, scale: float, group: int) -> torch.Tensor:
    n, heads, dim = q.shape
    n_cand = gidx.shape[1] * group
    out = torch.empty((n, n_cand), dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    q, keys, w = q.contiguous(), keys.contiguous(), w.float().contiguous()
    gidx, gval = gidx.contiguous(), gval.contiguous()
    _candidate_kernel[(n,)](q, keys, w, gidx, gval, out, _common.first_position(t), keys.shape[0], n_cand, float(scale),
                            q.stride(0), q.stride(1), keys.stride(0), w.stride(0), gidx.stride(0), out.stride(0),
                            KPOOL=kpool, H=heads, HP=_heads_padded(heads, 16), D=dim, G=group, BC=BC,
                            N_BLOCKS=triton.cdiv(n_cand, BC), num_warps=4)
    return out


def aot_compile(heads: int, dim: int, kpool: int, group: int, arch: int = 90) -> dict:
    """Both passes built for a GPU architecture without a GPU, specialised as the JIT specialises
    their launches (genolong.kernels.aot; lengths taken as multiples of 16): {name: kernel}."""
    hp = _heads_padded(heads, 1)
    strides = dict(stride_qt=heads * dim, stride_qh=dim, stride_kp=dim, stride_wt=heads)
    args1 = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", n_rows="i32", t0="i32", n_pools="i32",
                 n_groups="i32", scale="fp32", **strides, stride_ot="i32")
    const1 = dict(KPOOL=kpool, H=heads, HP=hp, D=dim, BM=block_queries(hp), BN=BN, G=group, N_INNER=N_INNER)
    args2 = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", gidx_ptr="*i64", gval_ptr="*fp32", out_ptr="*fp32", t0="i32",
                 n_pools="i32", n_cand="i32", scale="fp32", **strides, stride_gt="i32", stride_ot="i32")
    const2 = dict(KPOOL=kpool, H=heads, HP=_heads_padded(heads, 16), D=dim, G=group, BC=BC, N_BLOCKS=512 * group // BC)
    return {
        "group_max": aot.build(_group_max_kernel, args1, const1, num_warps=8, num_stages=2, arch=arch),
        "candidate_scores": aot.build(_candidate_kernel, args2, const2, num_warps=4, arch=arch),
    }


# ----------------------------------------------------------------------------- v2

# Pass 1 v2 tiles: BM queries x BN pools per product, one product per head. Every tile here
# (the default first; benchmarks/bench_indexer.py sweeps them on the GPU) fits sm_90's shared
# memory at 4 and 32 heads in the JIT's specialised build (tests/kernels/test_compile.py).
PASS1_TILES = [(64, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 4), (128, 128, 8, 3)]  # BM, BN, warps, stages
(BM2, BN2, WARPS2, STAGES2), N_INNER2 = PASS1_TILES[0], 8
# Pass 1 v2 keeps the q blocks of all heads in shared memory for the whole program while they
# take at most this much (4 heads x 64 queries x 128, bf16); with more heads it streams them.
RESIDENT_Q_BYTES = 64 << 10
# Pass 2 v2: candidates per gathered block.
BC2 = 128
# Groups per super-group: pass 1 also keeps the maximum of each SUPER consecutive groups.
SUPER = 8
# Longest row of super-group maxima the group selection holds in registers (4M tokens at kpool 4, G 8).
MAX_SUPER_GROUPS = 16384
# Warps of the two selection kernels: their in-register top-k (`_top_narrow`) holds its keys in 168
# registers a thread at 4 warps (sm_90), so an SM holds two programs.
SELECT_WARPS = 4


# What the resident kernel's q blocks and pipelined key blocks may take together: sm_90's 227 KiB
# less room for the rest (4 x 128 heads: 64 + 96 KiB, 167,936 bytes built).
RESIDENT_TOTAL_BYTES = 200 << 10


def q_resident(heads: int, dim: int, bm: int, bn: int = BN2, stages: int = STAGES2) -> bool:
    """Whether pass 1 v2 holds every head's [bm, dim] q block (16-bit) for the whole program: at most
    RESIDENT_Q_BYTES of q, and with the `stages` pipelined [bn, dim] key blocks within
    RESIDENT_TOTAL_BYTES (at head dim 256 one or two heads' q fit, but not beside three 64 KiB key
    stages: 233,472 / 266,240 bytes, more than an sm_90 block has; those stream q instead)."""
    q = heads * bm * dim * 2
    return q <= RESIDENT_Q_BYTES and q + stages * bn * dim * 2 <= RESIDENT_TOTAL_BYTES


@triton.jit
def _store_group_maxima(acc, blk, rows, live, t, out_ptr, sg_ptr, n_pools, n_groups, n_super, stride_ot, stride_st,
                        KPOOL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, SG: tl.constexpr):
    """Masks pool block `blk`'s [BM, BN] scores causally and stores their group and super-group maxima."""
    p = blk * BN + tl.arange(0, BN)
    ok = ((p[None, :] + 1) * KPOOL <= t[:, None] + 1) & (p[None, :] < n_pools)
    acc = tl.where(ok, acc, float("-inf"))
    gm = tl.max(tl.reshape(acc, (BM, BN // G, G)), axis=2)
    g = blk * (BN // G) + tl.arange(0, BN // G)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + g[None, :], gm, mask=live[:, None] & (g < n_groups)[None, :])
    sgm = tl.max(tl.reshape(gm, (BM, BN // (G * SG), SG)), axis=2)
    sg = blk * (BN // (G * SG)) + tl.arange(0, BN // (G * SG))
    tl.store(sg_ptr + rows[:, None].to(tl.int64) * stride_st + sg[None, :], sgm, mask=live[:, None] & (sg < n_super)[None, :])


@triton.jit
def _group_max_v2_kernel(q_ptr, k_ptr, w_ptr, out_ptr, sg_ptr, n_rows, t0, n_pools, n_groups, n_super,
                         stride_qt, stride_qh, stride_kp, stride_wt, stride_ot, stride_st,
                         KPOOL: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
                         N_INNER: tl.constexpr, STAGES: tl.constexpr):
    # Few heads: one [BM, D] x [D, BN] product per head, accumulated in the product's own register
    # layout (v1 stacked the heads into the rows of one product and had to move the accumulator
    # across threads to sum them). The softmax scale is folded into w by the caller (relu(s * c) =
    # c * relu(s) for c > 0), so the epilogue is one max and one fused multiply-add per head and element.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BM
    last_t = t0 + tl.minimum(row0 + BM, n_rows) - 1
    n_visible = tl.minimum((last_t + 1) // KPOOL, n_pools)
    blk0 = pid_n * N_INNER
    if blk0 < tl.cdiv(n_visible, BN):
        rows = row0 + tl.arange(0, BM)
        live = rows < n_rows
        t = t0 + rows
        d = tl.arange(0, D)
        # Every head's q block is loaded once, before the pool loop. Loaded inside it, the loads
        # were pipelined with the keys: H q blocks per stage, 291 KiB of shared memory at 4 heads.
        qs = ()
        ws = ()
        for h in tl.static_range(H):
            qs = qs + (tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                               mask=live[:, None], other=0.0),)
            ws = ws + (tl.load(w_ptr + rows.to(tl.int64) * stride_wt + h, mask=live, other=0.0),)
        # A constant trip count and no test inside the loop is what Triton software-pipelines: the
        # key loads of the next STAGES - 1 blocks are in flight while the current one is multiplied.
        # Blocks past the diagonal (at most N_INNER - 1 per row block) compute into the causal mask.
        for i in tl.range(0, N_INNER, num_stages=STAGES):
            blk = blk0 + i
            p = blk * BN + tl.arange(0, BN)
            k = tl.load(k_ptr + p[:, None].to(tl.int64) * stride_kp + d[None, :], mask=(p < n_pools)[:, None], other=0.0)
            kt = tl.trans(k)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for h in tl.static_range(H):
                acc += tl.maximum(tl.dot(qs[h], kt), 0.0) * ws[h][:, None]
            _store_group_maxima(acc, blk, rows, live, t, out_ptr, sg_ptr, n_pools, n_groups, n_super, stride_ot, stride_st,
                                KPOOL, BM, BN, G, SG)


@triton.jit
def _group_max_v2_streamed_kernel(q_ptr, k_ptr, w_ptr, out_ptr, sg_ptr, n_rows, t0, n_pools, n_groups, n_super,
                                  stride_qt, stride_qh, stride_kp, stride_wt, stride_ot, stride_st,
                                  KPOOL: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                                  BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, SG: tl.constexpr,
                                  N_INNER: tl.constexpr, STAGES: tl.constexpr):
    # Many heads (32 heads' q blocks take 512 KiB at BM 64): the same products, with the heads as
    # the pipelined loop. A pool block is loaded once and feeds H products, so its one exposed
    # load is amortised over them; the q blocks (H per pool block, the larger stream, re-read
    # from L2) are the loads in flight, STAGES - 1 heads ahead.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BM
    last_t = t0 + tl.minimum(row0 + BM, n_rows) - 1
    n_visible = tl.minimum((last_t + 1) // KPOOL, n_pools)
    blk0 = pid_n * N_INNER
    rows = row0 + tl.arange(0, BM)
    live = rows < n_rows
    t = t0 + rows
    d = tl.arange(0, D)
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_qt + d[None, :]
    w_rows = w_ptr + rows.to(tl.int64) * stride_wt
    # Pool blocks past the block's last visible pool are not visited (their maxima keep -inf).
    n_blocks = tl.cdiv(n_visible, BN)
    for i in range(N_INNER):
        blk = blk0 + i
        if blk < n_blocks:
            p = blk * BN + tl.arange(0, BN)
            k = tl.load(k_ptr + p[:, None].to(tl.int64) * stride_kp + d[None, :], mask=(p < n_pools)[:, None], other=0.0)
            kt = tl.trans(k)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for h in tl.range(0, H, num_stages=STAGES):
                qh = tl.load(q_rows + h * stride_qh, mask=live[:, None], other=0.0)
                wh = tl.load(w_rows + h, mask=live, other=0.0)
                acc += tl.maximum(tl.dot(qh, kt), 0.0) * wh[:, None]
            _store_group_maxima(acc, blk, rows, live, t, out_ptr, sg_ptr, n_pools, n_groups, n_super, stride_ot, stride_st,
                                KPOOL, BM, BN, G, SG)


@triton.jit
def _top_narrow(s, TOPK: tl.constexpr):
    """The TOPK largest finite entries of the 1-D fp32 block s: (chosen mask, slot of each chosen
    entry in [0, take), take = min(TOPK, number of finite entries)); ties at the threshold are taken
    by position. Each score becomes an order-preserving uint32 key (negative floats have their
    magnitude bits flipped); the take-th largest key is built bit by bit from the top (exact: no
    histogram buckets), stopping at the first threshold with exactly `take` keys at or above it
    (about 20 of 32 steps on distinct scores; at once when every finite entry is taken); the
    tie-break's running count is made only when ties straddle the threshold."""
    valid = s > float("-inf")
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    take = tl.minimum(n_valid, TOPK)
    bits = s.to(tl.uint32, bitcast=True)
    flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    # Invalid entries get 0; every valid key is above -inf's (0x007FFFFF), so kth = 1 takes them all.
    key = tl.where(valid, bits ^ flip, 0).to(tl.uint32)
    found = (n_valid <= TOPK).to(tl.int32)
    kth = found.to(tl.uint32)
    b = 0
    while (b < 32) & (found == 0):
        trial = kth | (tl.full((), 1, tl.uint32) << (31 - b).to(tl.uint32))
        count = tl.sum((key >= trial).to(tl.int32), axis=0)
        kth = tl.where(count >= take, trial, kth)
        found = (count == take).to(tl.int32)
        b += 1
    above = valid & (key > kth)
    tied = valid & (key == kth)
    room = take - tl.sum(above.to(tl.int32), axis=0)
    if tl.sum(tied.to(tl.int32), axis=0) > room:
        chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))
    else:
        chosen = above | tied
    return chosen, tl.cumsum(chosen.to(tl.int32), axis=0) - 1, take


@triton.jit
def _select_groups_kernel(gmax_ptr, sg_ptr, scratch_ptr, gidx_ptr, gval_ptr, n_groups, n_super,
                          stride_gm, stride_sg, stride_sc, stride_gt,
                          SG: tl.constexpr, NSG: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    # One query per program. The top TOPK groups lie in the top TOPK super-groups (the argument of
    # indexer/topk.py once more, one level up): choose those from the row of super-group maxima,
    # then the top TOPK groups among their SG * TOPK groups. Replaces torch.topk over the whole row
    # of group maxima (SG times longer) with two selections in registers.
    row = tl.program_id(0).to(tl.int64)
    sgi = tl.arange(0, NSG)
    sgv = tl.load(sg_ptr + row * stride_sg + sgi, mask=sgi < n_super, other=float("-inf"))
    chosen, slot, take = _top_narrow(sgv, TOPK)
    tl.store(scratch_ptr + row * stride_sc + slot, sgi, mask=chosen)
    # The chosen super-groups were written by other threads of this program.
    tl.debug_barrier()
    c = tl.arange(0, TOPK_P2 * SG)
    member = c // SG < take
    sup = tl.load(scratch_ptr + row * stride_sc + c // SG, mask=member, other=0)
    gid = sup * SG + c % SG
    ok = member & (gid < n_groups)
    gv = tl.load(gmax_ptr + row * stride_gm + gid, mask=ok, other=float("-inf"))
    chosen, slot, take = _top_narrow(gv, TOPK)
    tl.store(gidx_ptr + row * stride_gt + slot, gid.to(tl.int64), mask=chosen)
    tl.store(gval_ptr + row * stride_gt + slot, gv, mask=chosen)
    u = tl.arange(0, TOPK_P2)
    unused = (u >= take) & (u < TOPK)
    tl.store(gidx_ptr + row * stride_gt + u, tl.zeros((TOPK_P2,), tl.int64), mask=unused)
    tl.store(gval_ptr + row * stride_gt + u, tl.full((TOPK_P2,), float("-inf"), tl.float32), mask=unused)


@triton.jit
def _select_kernel(q_ptr, k_ptr, w_ptr, gidx_ptr, gval_ptr, scratch_ptr, out_ptr, t0, n_pools, n_cand,
                   stride_qt, stride_qh, stride_kp, stride_wt, stride_gt, stride_st, stride_ot,
                   KPOOL: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                   G: tl.constexpr, BC: tl.constexpr, N_BLOCKS: tl.constexpr, NC: tl.constexpr,
                   TOPK: tl.constexpr, TOPK_P2: tl.constexpr, TAIL: tl.constexpr):
    # One query per program: exact scores of its G * TOPK candidate pools (as v1's pass 2), then
    # the final top-TOPK chosen here instead of by torch.topk, and written straight out as token
    # indices with the tail pool: no candidate-score round trip through a top-k and an expansion.
    row = tl.program_id(0).to(tl.int64)
    t = t0 + row
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :], mask=(h < H)[:, None], other=0.0)
    w = tl.load(w_ptr + row * stride_wt + h, mask=h < H, other=0.0)
    # The softmax scale is folded into w by the caller (1.0 here).
    for i in range(N_BLOCKS):
        _score_candidates(q, w, k_ptr, gidx_ptr + row * stride_gt, gval_ptr + row * stride_gt, scratch_ptr + row * stride_st,
                          i * BC + tl.arange(0, BC), n_cand, n_pools, t, 1.0, stride_kp, KPOOL=KPOOL, D=D, G=G)
    # The scores were written by other threads of this program; the barrier makes them visible.
    tl.debug_barrier()

    c = tl.arange(0, NC)
    s = tl.load(scratch_ptr + row * stride_st + c, mask=c < n_cand, other=float("-inf"))
    chosen, slot, take = _top_narrow(s, TOPK)
    gi = tl.load(gidx_ptr + row * stride_gt + c // G, mask=c < n_cand, other=0)
    pool = gi * G + c % G
    j = tl.arange(0, KPOOL)
    out_row = out_ptr + row * stride_ot
    tl.store(out_row + slot[:, None] * KPOOL + j[None, :], (pool[:, None] * KPOOL + j[None, :]).to(tl.int32),
             mask=chosen[:, None])
    # The unused pool slots [take, TOPK) and the tail pool: disjoint from the slots written above.
    u = tl.arange(0, TOPK_P2)
    unused = (u >= take) & (u < TOPK)
    tl.store(out_row + u[:, None] * KPOOL + j[None, :], tl.full((TOPK_P2, KPOOL), -1, tl.int32), mask=unused[:, None])
    if TAIL:
        n_tail = (t + 1) % KPOOL
        tail = t + 1 - n_tail + j
        tl.store(out_row + TOPK * KPOOL + j, tl.where(j < n_tail, tail, -1).to(tl.int32), mask=j < KPOOL - 1)


def group_max_v2(q, keys, w, t, *, kpool: int, scale: float, group: int, sup: int = SUPER, bm: int = BM2, bn: int = BN2,
                 n_inner: int = N_INNER2, warps: int = WARPS2, stages: int = STAGES2, resident: bool | None = None):
    """Pass 1 v2: (group maxima [n, ceil(P/G)], maxima of `sup` consecutive groups, sup), fp32, -inf where none.
    `resident` picks the kernel (None: by `q_resident`)."""
    n, heads, dim = q.shape
    n_pools = keys.shape[0]
    if bn % (group * sup):
        raise KernelUnsupported(f"pass 1 v2 needs pool blocks of a multiple of {group * sup} pools, got {bn}")
    n_groups = -(-n_pools // group)
    n_super = -(-n_groups // sup)
    out = torch.full((n, n_groups), float("-inf"), dtype=torch.float32, device=q.device)
    sg = torch.full((n, n_super), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0 or n_pools == 0:
        return out, sg, sup
    q, keys = q.contiguous(), keys.contiguous()
    w = (w.float() * scale).contiguous()
    kernel = _pass1_v2_kernel(heads, dim, bm, resident, bn, stages)
    grid = (triton.cdiv(n, bm), triton.cdiv(triton.cdiv(n_pools, bn), n_inner))
    kernel[grid](q, keys, w, out, sg, n, _common.first_position(t), n_pools, n_groups, n_super,
                 q.stride(0), q.stride(1), keys.stride(0), w.stride(0), out.stride(0), sg.stride(0),
                 KPOOL=kpool, H=heads, D=dim, BM=bm, BN=bn, G=group, SG=sup, N_INNER=n_inner, STAGES=stages, num_warps=warps)
    return out, sg, sup


def _pass1_v2_kernel(heads: int, dim: int, bm: int, resident: bool | None, bn: int = BN2, stages: int = STAGES2):
    if resident is None:
        resident = q_resident(heads, dim, bm, bn, stages)
    return _group_max_v2_kernel if resident else _group_max_v2_streamed_kernel


def select_groups(maxima, topk_pools: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `topk_pools` groups from pass 1 v2's maxima: (group ids int64, their maxima; -inf = none)."""
    gmax, sg, sup = maxima
    n = gmax.shape[0]
    if sg.shape[1] > MAX_SUPER_GROUPS:
        raise KernelUnsupported(f"at most {MAX_SUPER_GROUPS} super-groups per row, got {sg.shape[1]}")
    gidx = torch.empty((n, topk_pools), dtype=torch.int64, device=gmax.device)
    gval = torch.empty((n, topk_pools), dtype=torch.float32, device=gmax.device)
    if n == 0:
        return gidx, gval
    scratch = torch.empty((n, topk_pools), dtype=torch.int32, device=gmax.device)
    topk_p2 = triton.next_power_of_2(topk_pools)
    _select_groups_kernel[(n,)](gmax, sg, scratch, gidx, gval, gmax.shape[1], sg.shape[1],
                                gmax.stride(0), sg.stride(0), scratch.stride(0), gidx.stride(0),
                                SG=sup, NSG=max(16, triton.next_power_of_2(sg.shape[1])), TOPK=topk_pools, TOPK_P2=topk_p2,
                                num_warps=SELECT_WARPS)
    return gidx, gval


def select_candidates(q, keys, w, t, gidx, gval, out, *, kpool: int, scale: float, group: int, topk_pools: int,
                      always_select_tail: bool) -> None:
    """Pass 2 v2: writes the op's rows for queries t into `out` [n, W] (int32, from the kernel alone)."""
    n, heads, dim = q.shape
    n_cand = gidx.shape[1] * group
    if n == 0:
        return
    q, keys = q.contiguous(), keys.contiguous()
    w = (w.float() * scale).contiguous()
    gidx, gval = gidx.contiguous(), gval.contiguous()
    scratch = torch.empty((n, max(1, n_cand)), dtype=torch.float32, device=q.device)
    _select_kernel[(n,)](q, keys, w, gidx, gval, scratch, out, _common.first_position(t), keys.shape[0], n_cand,
                         q.stride(0), q.stride(1), keys.stride(0), w.stride(0), gidx.stride(0), scratch.stride(0), out.stride(0),
                         KPOOL=kpool, H=heads, HP=_heads_padded(heads, 16), D=dim, G=group, BC=BC2,
                         N_BLOCKS=triton.cdiv(n_cand, BC2), NC=max(16, triton.next_power_of_2(n_cand)),
                         TOPK=topk_pools, TOPK_P2=max(1, triton.next_power_of_2(topk_pools)),
                         TAIL=always_select_tail and kpool > 1, num_warps=SELECT_WARPS)


def aot_compile_group_max_v2(heads: int, dim: int, kpool: int, group: int, tile: tuple = PASS1_TILES[0], arch: int = 90):
    """Pass 1 v2 with `tile` = (BM, BN, warps, stages), built for a GPU architecture without a GPU
    and specialised as the JIT specialises its launches (genolong.kernels.aot; lengths taken as
    multiples of 16)."""
    bm, bn, warps, stages = tile
    args = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", sg_ptr="*fp32", n_rows="i32", t0="i32",
                n_pools="i32", n_groups="i32", n_super="i32", stride_qt=heads * dim, stride_qh=dim, stride_kp=dim,
                stride_wt=heads, stride_ot="i32", stride_st="i32")
    const = dict(KPOOL=kpool, H=heads, D=dim, BM=bm, BN=bn, G=group, SG=SUPER, N_INNER=N_INNER2, STAGES=stages)
    return aot.build(_pass1_v2_kernel(heads, dim, bm, None, bn, stages), args, const, num_warps=warps, arch=arch)


def aot_compile_v2(heads: int, dim: int, kpool: int, group: int, topk_pools: int = 512, seq: int = 1 << 20,
                   arch: int = 90) -> dict:
    """The three v2 kernels with their default launch configs, built for a GPU architecture
    without a GPU and specialised as the JIT specialises their launches (the group selection for
    the super-groups of `seq` tokens): {name: kernel}."""
    argsg = dict(gmax_ptr="*fp32", sg_ptr="*fp32", scratch_ptr="*i32", gidx_ptr="*i64", gval_ptr="*fp32", n_groups="i32",
                 n_super="i32", stride_gm="i32", stride_sg="i32", stride_sc=topk_pools, stride_gt=topk_pools)
    n_super = -(-seq // kpool // (group * SUPER))
    constg = dict(SG=SUPER, NSG=max(16, triton.next_power_of_2(n_super)), TOPK=topk_pools, TOPK_P2=triton.next_power_of_2(topk_pools))
    n_cand = topk_pools * group
    args2 = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", gidx_ptr="*i64", gval_ptr="*fp32", scratch_ptr="*fp32",
                 out_ptr="*i32", t0="i32", n_pools="i32", n_cand=n_cand, stride_qt=heads * dim, stride_qh=dim, stride_kp=dim,
                 stride_wt=heads, stride_gt=topk_pools, stride_st=n_cand, stride_ot=topk_pools * kpool + kpool - 1)
    const2 = dict(KPOOL=kpool, H=heads, HP=_heads_padded(heads, 16), D=dim, G=group, BC=BC2, N_BLOCKS=n_cand // BC2,
                  NC=triton.next_power_of_2(n_cand), TOPK=topk_pools, TOPK_P2=triton.next_power_of_2(topk_pools), TAIL=True)
    return {
        "group_max_v2": aot_compile_group_max_v2(heads, dim, kpool, group, arch=arch),
        "select_groups": aot.build(_select_groups_kernel, argsg, constg, num_warps=SELECT_WARPS, arch=arch),
        "select_candidates": aot.build(_select_kernel, args2, const2, num_warps=SELECT_WARPS, arch=arch),
    }
