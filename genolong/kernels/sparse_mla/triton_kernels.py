"""Few-head sparse MLA in Triton: the kernels behind genolong/kernels/sparse_mla/op.py.

One program owns one query and a block of HB of its heads (all of them up to 64): it gathers
the query's selected latent rows in blocks of BN once for all those heads and multiplies them
on tensor cores with the heads stacked as the rows of the product. Heads past H are padding in
registers only (masked loads give zeros, masked stores drop them): nothing padded is ever
allocated or written.

- `_sparse_mla_fwd_kernel`: online softmax in fp32 over the row's slots (log2 domain), o
  accumulated in fp32 and written in the input dtype, the natural-log lse saved for the backward.
- `_sparse_mla_delta_kernel`: Delta = rowsum(dO * O) per (query, head) in fp32 (the softmax
  backward's correction term), once per query.
- `_sparse_mla_bwd_kernel`: recomputes P from q, the gathered keys and lse; dS = P * (dO.K -
  Delta); accumulates dq in registers and adds each slot block's dkv = dS^T q + P^T dO into an
  fp32 buffer with one relaxed atomic per (slot, column), after the sum over all heads in
  registers. With RANGED, a program handles, for 16 rows in turn, only the slots that fall in
  one key chunk (rows sorted, each chunk's slot range given), programs ordered chunk by chunk,
  so the rows of kv and of the fp32 dkv buffer that are being gathered and added to at any
  moment fit in L2; dq is then a partial sum per chunk, added atomically into an fp32 buffer.
  With PACK (at most half the head block's rows are heads: 1-8 heads) q and dO share one operand,
  3 products a slot block instead of 5 (`_sparse_mla_bwd_row_packed`).
  (The names say "sparse_mla" so that profiles attribute them.)

Slots hold key positions; -1 (and anything outside [0, S)) is an empty slot. All row offsets
are 64-bit. Launchers take an explicit `Config`; sparse_mla/op.py chooses (and times) them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)
_LOG2E = tl.constexpr(LOG2E)
MIN_HEAD_BLOCK = 16  # the tensor-core product's row count: fewer heads are padded in registers
RANGED_ROWS = 16  # rows per program of the key-chunked backward


@dataclass(frozen=True)
class Config:
    """Meta-parameters of one launch: heads per program, slots per step, warps, pipeline stages."""

    head_block: int
    block_n: int
    num_warps: int
    num_stages: int

    def label(self) -> str:
        return f"HB{self.head_block}/BN{self.block_n}/w{self.num_warps}/s{self.num_stages}"


def head_block(heads: int, limit: int = 64) -> int:
    """Heads per program: all of them (padded to a power of two, at least 16) up to `limit`."""
    return min(max(MIN_HEAD_BLOCK, triton.next_power_of_2(heads)), limit)


def packs(heads: int, config: Config) -> bool:
    """Whether the backward stacks q and dO into one operand (`_sparse_mla_bwd_row_packed`): with at
    most half the head block's rows being heads, in one head block."""
    return 2 * heads <= config.head_block


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) get exact fp32 products; 16-bit inputs run bf16/fp16 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


# Lengths, row offsets and the head count are not specialised (by divisibility), so one build
# serves every length and chunk of a run, and 4, 8 and 16 heads.
@triton.jit(do_not_specialize=["row0", "seq_q", "seq_kv", "width", "H"])
def _sparse_mla_fwd_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, row0, seq_q, seq_kv, width, scale_log2, H,
                HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                N_HB: tl.constexpr, PREC: tl.constexpr):
    # Head blocks of one query are neighbouring programs, so the second one finds the keys in L2.
    pid = tl.program_id(0)
    row = (pid // N_HB).to(tl.int64)
    heads = (pid % N_HB) * HB + tl.arange(0, HB)
    live = heads < H
    d = tl.arange(0, D)
    kv_rows = kv_ptr + ((row0 + row) // seq_q) * seq_kv * D
    q = tl.load(q_ptr + (row * H + heads[:, None]) * D + d[None, :], mask=live[:, None], other=0.0)
    m = tl.full([HB], float("-inf"), tl.float32)
    l = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, D], tl.float32)
    for start in range(0, width, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < width, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A head with no valid slot yet keeps m = -inf; shifting by 0 keeps exp2 away from NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(s - shift[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PREC)
        m = m_new
    empty = l == 0.0
    o = acc / tl.where(empty, 1.0, l)[:, None]
    tl.store(out_ptr + (row * H + heads[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=live[:, None])
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, l))) * _LN2)
    tl.store(lse_ptr + row * H + heads, lse, mask=live)


@triton.jit(do_not_specialize=["H"])
def _sparse_mla_delta_kernel(o_ptr, do_ptr, delta_ptr, H, HP: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HP)
    live = heads < H
    total = tl.zeros([HP], tl.float32)
    for c in range(0, D, DC):
        offs = (row * H + heads[:, None]) * D + c + tl.arange(0, DC)[None, :]
        o = tl.load(o_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        do = tl.load(do_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        total += tl.sum(o * do, 1)
    tl.store(delta_ptr + row * H + heads, total, mask=live)


@triton.jit
def _add_dkv(dst, dkv, valid):
    """One slot block's dkv rows added into the fp32 buffer."""
    tl.atomic_add(dst, dkv, mask=valid[:, None], sem="relaxed")


@triton.jit
def _write_dq(dst, dq, mask, DQ_ATOMIC: tl.constexpr):
    """A row's dq: added into the fp32 partial-sum buffer (key chunks) or stored in q's dtype."""
    if DQ_ATOMIC:
        tl.atomic_add(dst, dq, mask=mask, sem="relaxed")
    else:
        tl.store(dst, dq.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _sparse_mla_bwd_row(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi, hb,
             row0, seq_q, seq_kv, width, scale, scale_log2, H,
             HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, DQ_ATOMIC: tl.constexpr, PREC: tl.constexpr):
    """Slots [lo, hi) of one row, one head block: dq (stored, or added when DQ_ATOMIC) and dkv (added)."""
    heads = hb * HB + tl.arange(0, HB)
    live = heads < H
    d = tl.arange(0, D)
    batch = (row0 + row) // seq_q
    kv_rows = kv_ptr + batch * seq_kv * D
    dkv_rows = dkv_ptr + batch * seq_kv * D
    offs = (row * H + heads[:, None]) * D + d[None, :]
    q = tl.load(q_ptr + offs, mask=live[:, None], other=0.0)
    do = tl.load(do_ptr + offs, mask=live[:, None], other=0.0)
    lse = tl.load(lse_ptr + row * H + heads, mask=live, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + row * H + heads, mask=live, other=0.0)
    dq = tl.zeros([HB, D], tl.float32)
    for start in range(lo, hi, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < hi, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        # Only (live head, valid slot) pairs get a probability; an empty row's lse is -inf,
        # but all its slots are invalid, so the where never lets exp2(+inf) through.
        p = tl.where(live[:, None] & valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(k), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        # The whole head block's contribution to each selected key, summed before the atomic.
        dkv = tl.dot(tl.trans((ds * scale).to(k.dtype)), q, input_precision=PREC)
        dkv += tl.dot(tl.trans(p.to(k.dtype)), do, input_precision=PREC)
        _add_dkv(dkv_rows + j.to(tl.int64)[:, None] * D + d[None, :], dkv, valid)
    _write_dq(dq_ptr + offs, dq * scale, live[:, None], DQ_ATOMIC)


@triton.jit
def _sparse_mla_bwd_row_packed(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi,
             row0, seq_q, seq_kv, width, scale, scale_log2, H,
             HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, DQ_ATOMIC: tl.constexpr, PREC: tl.constexpr):
    """`_sparse_mla_bwd_row` for 2H <= HB heads (one head block): 3 of the 5 products per slot block.

    The head block has HB rows (16, the tensor-core product's least) but only H of them are heads
    (4 at glm53-mini), so q and dO share one operand: qd = [q; dO] (rows [0, H) and [H, 2H)), loaded
    as one tile. x = qd K^T gives q.k and dO.k in one product; dO.k is moved to the rows of its
    heads by a 16 x 16 product with a shift matrix (fp32 x as a bf16 high part plus a bf16
    remainder, ~16 mantissa bits; exact in fp32). dkv = dS^T q + P^T dO becomes [dS; P]^T qd, one
    product (the two stacks are disjoint rows: exact). dq = dS K is unchanged."""
    heads = tl.arange(0, HB)
    live = heads < H
    d = tl.arange(0, D)
    batch = (row0 + row) // seq_q
    kv_rows = kv_ptr + batch * seq_kv * D
    dkv_rows = dkv_ptr + batch * seq_kv * D
    offs = (row * H + heads[:, None]) * D + d[None, :]
    q = tl.load(q_ptr + offs, mask=live[:, None], other=0.0)
    do = tl.load(do_ptr + offs, mask=live[:, None], other=0.0)
    # up moves row j to row j + H, down row j + H to row j: one 1 per row, exact in any dtype.
    up = (heads[:, None] == heads[None, :] + H).to(q.dtype)
    down = (heads[None, :] == heads[:, None] + H).to(q.dtype)
    qd = (q.to(tl.float32) + tl.dot(up, do, input_precision=PREC)).to(q.dtype)
    lse = tl.load(lse_ptr + row * H + heads, mask=live, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + row * H + heads, mask=live, other=0.0)
    dq = tl.zeros([HB, D], tl.float32)
    for start in range(lo, hi, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < hi, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        x = tl.dot(qd, tl.trans(k), input_precision=PREC)  # rows [0, H): q.k; [H, 2H): dO.k
        if PREC == "ieee":
            dp = tl.dot(down, x, input_precision=PREC)
        else:
            x_hi = x.to(k.dtype)
            dp = tl.dot(down, x_hi) + tl.dot(down, (x - x_hi.to(tl.float32)).to(k.dtype))
        # Rows past H (dO.k, zeros) are not heads: no probability, so no dS.
        p = tl.where(live[:, None] & valid[None, :], tl.exp2(x * scale_log2 - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        stacked = (ds * scale + tl.dot(up, p.to(k.dtype), input_precision=PREC)).to(k.dtype)  # [dS * scale; P]
        dkv = tl.dot(tl.trans(stacked), qd, input_precision=PREC)
        _add_dkv(dkv_rows + j.to(tl.int64)[:, None] * D + d[None, :], dkv, valid)
    _write_dq(dq_ptr + offs, dq * scale, live[:, None], DQ_ATOMIC)


@triton.jit(do_not_specialize=["row0", "n_rows", "seq_q", "seq_kv", "width", "n_bounds", "H"])
def _sparse_mla_bwd_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, bounds_ptr,
                row0, n_rows, seq_q, seq_kv, width, n_bounds, scale, scale_log2, H,
                HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, N_HB: tl.constexpr,
                RANGED: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr, PACK: tl.constexpr):
    # Per-row tensors (q, idx, dO, lse, Delta, dq) start at this launch's first row; row0 + row is
    # the row in the whole [B*T] sequence (for the batch of its keys).
    pid = tl.program_id(0)
    if RANGED:
        # pid = (key chunk, group of ROWS rows, head block), the chunk slowest. Most (chunk, row)
        # pairs of causal selections are empty (keys past the row); a group of rows costs one
        # load of its bounds to find that out, instead of one program per row.
        n_groups = tl.cdiv(n_rows, ROWS)
        chunk = pid // (n_groups * N_HB)
        rest = pid % (n_groups * N_HB)
        first = (rest // N_HB).to(tl.int64) * ROWS
        hb = rest % N_HB
        rows = first + tl.arange(0, ROWS)
        los = tl.load(bounds_ptr + rows * n_bounds + chunk, mask=rows < n_rows, other=0)
        his = tl.load(bounds_ptr + rows * n_bounds + chunk + 1, mask=rows < n_rows, other=0)
        if tl.max(his - los, 0) > 0:
            for r in range(ROWS):
                row = first + r
                if row < n_rows:
                    lo = tl.load(bounds_ptr + row * n_bounds + chunk)
                    hi = tl.load(bounds_ptr + row * n_bounds + chunk + 1)
                    if hi > lo:
                        if PACK:
                            _sparse_mla_bwd_row_packed(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi,
                                     row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, True, PREC)
                        else:
                            _sparse_mla_bwd_row(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi, hb,
                                     row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, True, PREC)
    elif PACK:
        _sparse_mla_bwd_row_packed(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, pid.to(tl.int64), 0, width,
                 row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, False, PREC)
    else:
        _sparse_mla_bwd_row(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, (pid // N_HB).to(tl.int64), 0, width,
                 pid % N_HB, row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, False, PREC)


# ----------------------------------------------------------------------------- launchers
# Tensors are contiguous: q/out/dO/dq [R, H, D] (R = B*T rows), kv [B*S, D], idx [R, W],
# lse/Delta [R, H] fp32, dkv [B*S, D] fp32.


def forward(q, kv, idx, out, lse, *, row0: int, seq_q: int, seq_kv: int, scale: float, config: Config) -> None:
    """out and lse of the rows of this launch (per-row tensors start at row `row0` of [B*T])."""
    rows, heads, dim = q.shape
    n_hb = triton.cdiv(heads, config.head_block)
    if rows == 0:
        return
    _sparse_mla_fwd_kernel[(rows * n_hb,)](q, kv, idx, out, lse, row0, seq_q, seq_kv, idx.shape[1], scale * LOG2E, heads,
                                HB=config.head_block, D=dim, BN=config.block_n, N_HB=n_hb,
                                PREC=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages)


def delta(out, dout, dst) -> None:
    rows, heads, dim = out.shape
    if rows:
        _sparse_mla_delta_kernel[(rows,)](out, dout, dst, heads, HP=triton.next_power_of_2(heads), D=dim, DC=min(dim, 128), num_warps=4)


def backward(q, kv, idx, dout, lse, dlt, dq, dkv, *, row0: int, seq_q: int, seq_kv: int, scale: float,
             config: Config, bounds=None) -> None:
    """dq and dkv (fp32, added to) for the rows of this launch; dq is stored (q's dtype) in one pass,
    added to (an fp32 buffer) with key chunks.

    `bounds` [rows, C + 1] int32: row r's slots of key chunk c are [bounds[r, c], bounds[r, c+1])
    of its (sorted) idx row; None: every slot in one pass. Where at most half the head block's rows
    are heads (`packs`), q and dO are stacked into one operand."""
    rows, heads, dim = q.shape
    if rows == 0:
        return
    n_hb = triton.cdiv(heads, config.head_block)
    if bounds is None:
        n_bounds, grid = 1, rows * n_hb
    else:
        n_bounds, grid = bounds.shape[1], (bounds.shape[1] - 1) * triton.cdiv(rows, RANGED_ROWS) * n_hb
    _sparse_mla_bwd_kernel[(grid,)](q, kv, idx, dout, lse, dlt, dq, dkv, idx if bounds is None else bounds,
                         row0, rows, seq_q, seq_kv, idx.shape[1], n_bounds, scale, scale * LOG2E, heads,
                         HB=config.head_block, D=dim, BN=config.block_n, N_HB=n_hb,
                         RANGED=bounds is not None, ROWS=RANGED_ROWS, PACK=packs(heads, config),
                         PREC=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages)


def aot_compile(kind: str, heads: int, dim: int, config: Config, *, ranged: bool = False, arch: int = 90):
    """Compile "fwd" or "bwd" for a GPU architecture without a GPU, specialised as the JIT
    specialises a launch (genolong/kernels/aot.py): the CPU build check."""
    from genolong.kernels import aot

    meta = dict(HB=config.head_block, D=dim, BN=config.block_n, N_HB=triton.cdiv(heads, config.head_block), PREC="tf32")
    if kind == "fwd":
        fn = _sparse_mla_fwd_kernel
        args = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32", row0="i32",
                    seq_q="i32", seq_kv="i32", width="i32", scale_log2="fp32", H="i32")
    else:
        fn = _sparse_mla_bwd_kernel
        meta.update(RANGED=ranged, ROWS=RANGED_ROWS, PACK=packs(heads, config))
        args = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", do_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32",
                    dq_ptr="*fp32" if ranged else "*bf16", dkv_ptr="*fp32", bounds_ptr="*i32", row0="i32", n_rows="i32",
                    seq_q="i32", seq_kv="i32", width="i32", n_bounds="i32", scale="fp32", scale_log2="fp32", H="i32")
    return aot.build(fn, args, meta, num_warps=config.num_warps, num_stages=config.num_stages, arch=arch)
