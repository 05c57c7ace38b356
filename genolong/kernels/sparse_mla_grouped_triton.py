"""Few-head sparse MLA in Triton, the grouped variant: key chunk by key chunk, queries stacked.

The kernels behind genolong/kernels/sparse_mla_grouped.py. Two ideas, in both passes:

- **Key chunk by key chunk.** The host launches one kernel per chunk of keys, in order, so every
  program running at a given moment gathers (and, in the backward, adds dkv into) the rows of one
  chunk: they stay in L2 instead of coming from DRAM at random. What a query has gathered so far
  lives between launches in fp32 buffers: the forward's online-softmax state (m, l, acc), the
  backward's dq. Each launch reads and writes them once per (query, chunk).
- **Queries stacked.** A program owns QG consecutive queries and a block of HB of their heads
  (QG x HB = 16 or 32 rows: at 4 heads, 4 queries fill the tensor-core rows that v1 pads). Their
  selections were sorted together by the host, packed as key * QG + (query within the group), so
  the group's slots in a chunk are one contiguous range, gathered in blocks of BN with one long
  software pipeline; a slot's column of the score product counts only for its own query's rows
  (a block-diagonal mask), so nothing is computed for a pair that does not exist beyond the
  padding v1 already paid.

Packed slots: key * QG + r for a valid key, -1 for an empty slot (the host maps anything outside
[0, S) to -1 before packing). A launch's queries belong to one batch element (the host splits
query chunks there), so kv is that element's rows. All row offsets are 64-bit. (The names say
"sparse_mla" so that profiles attribute them.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from genolong.kernels.sparse_mla_triton import LOG2E, Config, dot_precision

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _stacked_rows(grp, hb, n_rows, H, QG: tl.constexpr, HB: tl.constexpr):
    """Row i of a program's stacked operand: query r = i // HB of the group, head hb*HB + i % HB."""
    i = tl.arange(0, QG * HB)
    r = i // HB
    row = grp * QG + r
    head = hb * HB + i % HB
    return r, row, head, (head < H) & (row < n_rows)


@triton.jit
def _slots(pidx_ptr, grp, start, hi, seq_kv, width_g, D: tl.constexpr, BN: tl.constexpr, LOG2_QG: tl.constexpr):
    """One block of the group's packed slots: (query within the group, valid, the key's offset in kv)."""
    slot = start + tl.arange(0, BN)
    packed = tl.load(pidx_ptr + grp * width_g + slot, mask=slot < hi, other=-1)
    key = packed >> LOG2_QG
    valid = (packed >= 0) & (key < seq_kv)
    return packed & ((1 << LOG2_QG) - 1), valid, key.to(tl.int64) * D


@triton.jit
def _own(r_i, r, valid, QG: tl.constexpr):
    """[rows, BN]: slot j counts for stacked row i (it is valid and its query is row i's)."""
    if QG == 1:
        # One query per program: no block-diagonal mask (it costs registers the 64-head builds lack).
        return tl.broadcast_to(valid[None, :], (r_i.shape[0], valid.shape[0]))
    return (r_i[:, None] == r[None, :]) & valid[None, :]


@triton.jit(do_not_specialize=["n_rows", "seq_kv", "width_g", "n_bounds", "chunk", "group0", "H"])
def _sparse_mla_fwd_grouped_kernel(q_ptr, kv_ptr, pidx_ptr, bounds_ptr, acc_ptr, m_ptr, l_ptr,
                                   n_rows, seq_kv, width_g, n_bounds, chunk, group0, scale_log2, H,
                                   HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, N_HB: tl.constexpr,
                                   QG: tl.constexpr, LOG2_QG: tl.constexpr, PREC: tl.constexpr):
    # The online softmax continues from the state the earlier chunks left (m in the log2 domain).
    pid = tl.program_id(0)
    grp = (group0 + pid // N_HB).to(tl.int64)
    hb = pid % N_HB
    lo = tl.load(bounds_ptr + grp * n_bounds + chunk)
    hi = tl.load(bounds_ptr + grp * n_bounds + chunk + 1)
    if hi > lo:
        r_i, row, head, live = _stacked_rows(grp, hb, n_rows, H, QG, HB)
        d = tl.arange(0, D)
        at = (row * H + head)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + at, mask=live[:, None], other=0.0)
        m = tl.load(m_ptr + row * H + head, mask=live, other=float("-inf"))
        l = tl.load(l_ptr + row * H + head, mask=live, other=0.0)
        # A row's first chunk finds no state (m = -inf): its acc (zeros) is not read.
        acc = tl.load(acc_ptr + at, mask=(live & (m > float("-inf")))[:, None], other=0.0)
        for start in range(lo, hi, BN):
            r, valid, kv_at = _slots(pidx_ptr, grp, start, hi, seq_kv, width_g, D, BN, LOG2_QG)
            k = tl.load(kv_ptr + kv_at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
            s = tl.where(_own(r_i, r, valid, QG), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # A row with no valid slot yet keeps m = -inf; shifting by 0 keeps exp2 away from NaN.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - shift)
            p = tl.exp2(s - shift[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PREC)
            m = m_new
        tl.store(acc_ptr + at, acc, mask=live[:, None])
        tl.store(m_ptr + row * H + head, m, mask=live)
        tl.store(l_ptr + row * H + head, l, mask=live)


@triton.jit(do_not_specialize=["n_rows", "seq_kv", "width_g", "n_bounds", "chunk", "group0", "H"])
def _sparse_mla_bwd_grouped_kernel(q_ptr, kv_ptr, pidx_ptr, bounds_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
                                   n_rows, seq_kv, width_g, n_bounds, chunk, group0, scale, scale_log2, H,
                                   HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, N_HB: tl.constexpr,
                                   QG: tl.constexpr, LOG2_QG: tl.constexpr, ADD_DKV: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    grp = (group0 + pid // N_HB).to(tl.int64)
    hb = pid % N_HB
    lo = tl.load(bounds_ptr + grp * n_bounds + chunk)
    hi = tl.load(bounds_ptr + grp * n_bounds + chunk + 1)
    if hi > lo:
        r_i, row, head, live = _stacked_rows(grp, hb, n_rows, H, QG, HB)
        d = tl.arange(0, D)
        at = (row * H + head)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + at, mask=live[:, None], other=0.0)
        do = tl.load(do_ptr + at, mask=live[:, None], other=0.0)
        lse = tl.load(lse_ptr + row * H + head, mask=live, other=0.0) * _LOG2E
        delta = tl.load(delta_ptr + row * H + head, mask=live, other=0.0)
        dq = tl.zeros([QG * HB, D], tl.float32)
        for start in range(lo, hi, BN):
            r, valid, kv_at = _slots(pidx_ptr, grp, start, hi, seq_kv, width_g, D, BN, LOG2_QG)
            k = tl.load(kv_ptr + kv_at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            # Only (live row, its own query's valid slot) pairs get a probability; an empty row's
            # lse is -inf, but it has no such pair, so the where never lets exp2(+inf) through.
            p = tl.where(live[:, None] & _own(r_i, r, valid, QG), tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(k), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
            if ADD_DKV:
                # Every stacked row's contribution to each selected key, summed before the atomic.
                dkv = tl.dot(tl.trans((ds * scale).to(k.dtype)), q, input_precision=PREC)
                dkv += tl.dot(tl.trans(p.to(k.dtype)), do, input_precision=PREC)
                tl.atomic_add(dkv_ptr + kv_at[:, None] + d[None, :], dkv, mask=valid[:, None], sem="relaxed")
        # One program owns these (row, head) pairs in this launch: a plain read-modify-write.
        dq_old = tl.load(dq_ptr + at, mask=live[:, None], other=0.0)
        tl.store(dq_ptr + at, dq_old + dq * scale, mask=live[:, None])


# ----------------------------------------------------------------------------- launchers
# A launch's rows are queries of one batch element: per-row tensors (q, dO [R, H, D], lse/Delta
# [R, H], the fp32 state and dq) start at its first row, kv and dkv [S, D] are that element's,
# packed [G, QG*W] and bounds [G, C+1] int32 per group.


def _log2(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"the query group must be a power of two, got {n}")
    return n.bit_length() - 1


def _check_unsplit(config: Config) -> None:
    """The grouped kernels have no split products (Config.split_k): a split config pinned for v1
    must not run here under its label."""
    if config.split_k > 1:
        raise ValueError(f"{config.label()}: the grouped and key-chunked passes have no split products; "
                         "use split_k 1, or fwd_mode 'query' with dkv_mode 'keychunk' or 'atomic'")


def forward_chunk(q, kv, packed, bounds, acc, m, l, *, chunk: int, groups: tuple[int, int], scale: float,
                  config: Config) -> None:
    """Fold key chunk `chunk` into the online-softmax state (acc [R,H,D], m, l [R,H] fp32) of the groups [g0, g1)."""
    _check_unsplit(config)
    rows, heads, dim = q.shape
    n_hb = triton.cdiv(heads, config.head_block)
    g0, g1 = groups
    if g1 <= g0:
        return
    _sparse_mla_fwd_grouped_kernel[((g1 - g0) * n_hb,)](
        q, kv, packed, bounds, acc, m, l, rows, kv.shape[0], packed.shape[1], bounds.shape[1], chunk, g0,
        scale * LOG2E, heads, HB=config.head_block, D=dim, BN=config.block_n, N_HB=n_hb, QG=config.query_group,
        LOG2_QG=_log2(config.query_group), PREC=dot_precision(q.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages)


def backward_chunk(q, kv, packed, bounds, dout, lse, dlt, dq, dkv, *, chunk: int, groups: tuple[int, int], scale: float,
                   config: Config, add_dkv: bool = True) -> None:
    """Add key chunk `chunk`'s share of dq (fp32 [R,H,D], scaled) and dkv (fp32 [S,D]) for the groups [g0, g1).

    add_dkv=False skips the dkv products and adds (wrong gradients: for the benchmark's probe of
    what the adds cost)."""
    _check_unsplit(config)
    rows, heads, dim = q.shape
    n_hb = triton.cdiv(heads, config.head_block)
    g0, g1 = groups
    if g1 <= g0:
        return
    _sparse_mla_bwd_grouped_kernel[((g1 - g0) * n_hb,)](
        q, kv, packed, bounds, dout, lse, dlt, dq, dkv, rows, kv.shape[0], packed.shape[1], bounds.shape[1], chunk, g0, scale, scale * LOG2E, heads, HB=config.head_block, D=dim, BN=config.block_n, N_HB=n_hb,
        QG=config.query_group, LOG2_QG=_log2(config.query_group), ADD_DKV=add_dkv, PREC=dot_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)


def aot_compile(kind: str, heads: int, dim: int, config: Config, *, arch: int = 90):
    """Compile "fwd" or "bwd" for a GPU architecture without a GPU, specialised as the JIT
    specialises a launch (genolong/kernels/aot.py): the CPU build check."""
    from genolong.kernels import aot

    meta = dict(HB=config.head_block, D=dim, BN=config.block_n, N_HB=triton.cdiv(heads, config.head_block),
                QG=config.query_group, LOG2_QG=_log2(config.query_group), PREC="tf32")
    ints = dict.fromkeys(("n_rows", "seq_kv", "width_g", "n_bounds", "chunk", "group0", "H"), "i32")
    if kind == "fwd":
        fn = _sparse_mla_fwd_grouped_kernel
        args = dict(q_ptr="*bf16", kv_ptr="*bf16", pidx_ptr="*i32", bounds_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32",
                    l_ptr="*fp32", scale_log2="fp32", **ints)
    else:
        fn = _sparse_mla_bwd_grouped_kernel
        meta["ADD_DKV"] = True
        args = dict(q_ptr="*bf16", kv_ptr="*bf16", pidx_ptr="*i32", bounds_ptr="*i32", do_ptr="*bf16", lse_ptr="*fp32",
                    delta_ptr="*fp32", dq_ptr="*fp32", dkv_ptr="*fp32", scale="fp32", scale_log2="fp32", **ints)
    return aot.build(fn, args, meta, num_warps=config.num_warps, num_stages=config.num_stages, arch=arch)
