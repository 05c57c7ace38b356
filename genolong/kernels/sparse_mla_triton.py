"""Few-head sparse MLA in Triton: the kernels behind genolong/kernels/sparse_mla.py.

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
  3 products a slot block instead of 5 (`_sparse_mla_bwd_row_packed`). SLOTS, the slot-major form
  (`_sparse_mla_bwd_row_slots`), was measured slower and is a benchmark probe only.
  (The names say "sparse_mla" so that profiles attribute them.)

Slots hold key positions; -1 (and anything outside [0, S)) is an empty slot. All row offsets
are 64-bit. Launchers take an explicit `Config`; sparse_mla.py chooses (and times) them.
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
DKV_OPS = {"skip": 0, "add": 1, "store": 2}  # "skip", "store": probes only


@dataclass(frozen=True)
class Config:
    """Meta-parameters of one launch: heads per program, slots per step, warps, pipeline stages,
    and (the grouped kernels only) queries per program."""

    head_block: int
    block_n: int
    num_warps: int
    num_stages: int
    query_group: int = 1
    # Backward only: the slots as the products' rows (_sparse_mla_bwd_row_slots). Measured slower
    # than the head-major pass (H200, 2026-12-02): a probe configuration, never a candidate.
    slot_major: bool = False
    # The score products (q K^T, dO K^T) split over the latent dimension: `split_k` slices of D,
    # at least one per warp (the batch of a 3-D product), summed after (`_dot_kt`). 1: one product.
    split_k: int = 1

    def label(self) -> str:
        group = f"/QG{self.query_group}" if self.query_group > 1 else ""
        split = f"/K{self.split_k}" if self.split_k > 1 else ""
        return f"HB{self.head_block}{group}/BN{self.block_n}/w{self.num_warps}/s{self.num_stages}{split}" + ("/T" if self.slot_major else "")


def head_block(heads: int, limit: int = 64) -> int:
    """Heads per program: all of them (padded to a power of two, at least 16) up to `limit`."""
    return min(max(MIN_HEAD_BLOCK, triton.next_power_of_2(heads)), limit)


def slot_columns(dim: int) -> int:
    """dkv columns per product of the slot-major backward: 128 ([BN, 128] fp32 in registers)."""
    return min(dim, 128)


def packs(heads: int, config: Config) -> bool:
    """Whether the backward stacks q and dO into one operand (`_sparse_mla_bwd_row_packed`): with at
    most half the head block's rows being heads, in one head block, head-major."""
    return not config.slot_major and 2 * heads <= config.head_block


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) get exact fp32 products; 16-bit inputs run bf16/fp16 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _split_cols(x, SPLIT: tl.constexpr):
    """[R, D] -> [SPLIT, R, D // SPLIT] (the D columns' slices as a batch), the A operand of `_dot_kt`;
    x itself when SPLIT is 1."""
    if SPLIT == 1:
        out = x
    else:
        out = tl.permute(tl.reshape(x, [x.shape[0], SPLIT, x.shape[1] // SPLIT]), [1, 0, 2])
    return out


@triton.jit
def _dot_kt(a, k, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """a K^T for the gathered keys k [BN, D], fp32 [R, BN]; a as `_split_cols` gives it.

    With SPLIT 1, one product: the warps split the BN columns of a [16, BN] result, so each runs the
    whole K = 512 reduction as one dependent mma chain and reads all of a (16 KiB at 16 x 512) from
    shared memory every slot block (8 warps over BN = 32 read it 8 times, twice over for the n8
    tiles). With SPLIT > 1, a batched product over D's slices puts one slice per warp (the batch is
    the warps' dimension): a chain of 512 / SPLIT, each warp reading only its slice of a and of k;
    the partial sums are added across warps after (through shared memory: SPLIT x R x BN fp32)."""
    if SPLIT == 1:
        out = tl.dot(a, tl.trans(k), input_precision=PREC)
    else:
        k3 = tl.permute(tl.reshape(k, [k.shape[0], SPLIT, k.shape[1] // SPLIT]), [1, 2, 0])
        out = tl.sum(tl.dot(a, k3, input_precision=PREC), 0)
    return out


@triton.jit
def _red_add_pairs(ptrs, values, mask):
    """dst += values (fp32) by one `red.global.add.v2.f32` per two neighbouring elements a thread
    holds, in whatever layout the values have: a tensor-core product's accumulator holds columns 2t
    and 2t + 1 of a row, so its [16, 512] dkv block is added where it was computed. tl.atomic_add
    first moves the block into a coalesced layout through shared memory (32 KiB written and read
    per slot block of 16). A pair whose second address is not the first's + 4 bytes (another
    layout) is added element by element, so the result never depends on the layout. A neighbouring
    pair is 8-byte aligned, as the vector add needs, without a check in the loop (it would cost
    ~25% more instructions there): a thread's consecutive columns in any Triton layout come in runs
    of 2^k starting at a multiple of 2^k, the row offsets are multiples of an even D, and
    `backward` takes this path only for 8-byte aligned dq and dkv buffers and even D. Unlike
    tl.atomic_add, nothing here masks elements a layout replicates over several threads (each copy
    would be added): the products' accumulators it is given (#mma, warps over the columns) hold
    each element once, as the sm_90 builds show. GPU (sm_90) only: the interpreter has no PTX (the
    callers take tl.atomic_add there)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .pred first, second, adjacent, both, single;
        .reg .b64 next;
        setp.ne.b32 first, $6, 0;
        setp.ne.b32 second, $7, 0;
        add.s64 next, $2, 4;
        setp.eq.s64 adjacent, next, $3;
        and.pred both, first, second;
        and.pred both, both, adjacent;
        @both red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};
        not.pred single, both;
        and.pred first, first, single;
        and.pred second, second, single;
        @first red.relaxed.gpu.global.add.f32 [$2], $4;
        @second red.relaxed.gpu.global.add.f32 [$3], $5;
        mov.b32 $0, 0;
        mov.b32 $1, 0;
        }""",
        constraints="=r,=r,l,l,f,f,r,r",
        args=[ptrs.to(tl.int64), values, mask.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=2)


# Lengths, row offsets and the head count are not specialised (by divisibility), so one build
# serves every length and chunk of a run, and 4, 8 and 16 heads.
@triton.jit(do_not_specialize=["row0", "seq_q", "seq_kv", "width", "H"])
def _sparse_mla_fwd_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, row0, seq_q, seq_kv, width, scale_log2, H,
                HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                N_HB: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr):
    # Head blocks of one query are neighbouring programs, so the second one finds the keys in L2.
    pid = tl.program_id(0)
    row = (pid // N_HB).to(tl.int64)
    heads = (pid % N_HB) * HB + tl.arange(0, HB)
    live = heads < H
    d = tl.arange(0, D)
    kv_rows = kv_ptr + ((row0 + row) // seq_q) * seq_kv * D
    q = _split_cols(tl.load(q_ptr + (row * H + heads[:, None]) * D + d[None, :], mask=live[:, None], other=0.0), SPLIT)
    m = tl.full([HB], float("-inf"), tl.float32)
    l = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, D], tl.float32)
    for start in range(0, width, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < width, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        s = _dot_kt(q, k, SPLIT, PREC) * scale_log2
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
def _write_dkv(dst, dkv, valid, DKV_OP: tl.constexpr, RED: tl.constexpr):
    """One slot block's dkv rows: added (DKV_OP 1; with RED in the product's own layout,
    `_red_add_pairs`), or stored (2: the benchmark's probe, wrong dkv)."""
    if DKV_OP == 1:
        if RED:
            _red_add_pairs(dst, dkv, tl.broadcast_to(valid[:, None], dkv.shape))
        else:
            tl.atomic_add(dst, dkv, mask=valid[:, None], sem="relaxed")
    else:
        tl.store(dst, dkv, mask=valid[:, None])


@triton.jit
def _write_dq(dst, dq, mask, DQ_ATOMIC: tl.constexpr, RED: tl.constexpr):
    """A row's dq: added into the fp32 partial-sum buffer (key chunks) or stored in q's dtype."""
    if DQ_ATOMIC:
        if RED:
            _red_add_pairs(dst, dq, tl.broadcast_to(mask, dq.shape))
        else:
            tl.atomic_add(dst, dq, mask=mask, sem="relaxed")
    else:
        tl.store(dst, dq.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _sparse_mla_bwd_row(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi, hb,
             row0, seq_q, seq_kv, width, scale, scale_log2, H,
             HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, DQ_ATOMIC: tl.constexpr, PREC: tl.constexpr,
             DKV_OP: tl.constexpr, SPLIT: tl.constexpr, RED: tl.constexpr):
    """Slots [lo, hi) of one row, one head block: dq (stored, or added when DQ_ATOMIC) and dkv (added;
    DKV_OP 0 / 2 skip it / store it instead: the benchmark's probes of the adds' cost, wrong dkv)."""
    heads = hb * HB + tl.arange(0, HB)
    live = heads < H
    d = tl.arange(0, D)
    batch = (row0 + row) // seq_q
    kv_rows = kv_ptr + batch * seq_kv * D
    dkv_rows = dkv_ptr + batch * seq_kv * D
    offs = (row * H + heads[:, None]) * D + d[None, :]
    q = tl.load(q_ptr + offs, mask=live[:, None], other=0.0)
    do = tl.load(do_ptr + offs, mask=live[:, None], other=0.0)
    q_cols, do_cols = _split_cols(q, SPLIT), _split_cols(do, SPLIT)
    lse = tl.load(lse_ptr + row * H + heads, mask=live, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + row * H + heads, mask=live, other=0.0)
    dq = tl.zeros([HB, D], tl.float32)
    for start in range(lo, hi, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < hi, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        s = _dot_kt(q_cols, k, SPLIT, PREC)
        # Only (live head, valid slot) pairs get a probability; an empty row's lse is -inf,
        # but all its slots are invalid, so the where never lets exp2(+inf) through.
        p = tl.where(live[:, None] & valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = _dot_kt(do_cols, k, SPLIT, PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        if DKV_OP != 0:
            # The whole head block's contribution to each selected key, summed before the atomic.
            dkv = tl.dot(tl.trans((ds * scale).to(k.dtype)), q, input_precision=PREC)
            dkv += tl.dot(tl.trans(p.to(k.dtype)), do, input_precision=PREC)
            _write_dkv(dkv_rows + j.to(tl.int64)[:, None] * D + d[None, :], dkv, valid, DKV_OP, RED)
    _write_dq(dq_ptr + offs, dq * scale, live[:, None], DQ_ATOMIC, RED)


@triton.jit
def _sparse_mla_bwd_row_packed(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi,
             row0, seq_q, seq_kv, width, scale, scale_log2, H,
             HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, DQ_ATOMIC: tl.constexpr, PREC: tl.constexpr,
             DKV_OP: tl.constexpr, SPLIT: tl.constexpr, RED: tl.constexpr):
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
    if SPLIT == 1 and not RED:
        q = tl.load(q_ptr + offs, mask=live[:, None], other=0.0)
        do = tl.load(do_ptr + offs, mask=live[:, None], other=0.0)
        # up moves row j to row j + H, down row j + H to row j: one 1 per row, exact in any dtype.
        # (Made after the loads, as before the opt-in forms below: the default build is unchanged.)
        up = (heads[:, None] == heads[None, :] + H).to(q.dtype)
        down = (heads[None, :] == heads[:, None] + H).to(q.dtype)
        qd = (q.to(tl.float32) + tl.dot(up, do, input_precision=PREC)).to(q.dtype)
    else:
        up = (heads[:, None] == heads[None, :] + H).to(q_ptr.dtype.element_ty)
        down = (heads[None, :] == heads[:, None] + H).to(q_ptr.dtype.element_ty)
        # Rows [0, H) from q, [H, 2H) from dO as one loaded tile, which stays in shared memory for
        # both of its operand roles (the computed qd above is moved between layouts every slot
        # block). Only with the opt-in split products or layout adds so far (with the layout adds the
        # computed qd spills at 16x16x4x5): not yet timed against the form above on its own.
        qd_rows = tl.where(live, q_ptr + (row * H + heads) * D, do_ptr + (row * H + heads - H) * D)
        qd = tl.load(qd_rows[:, None] + d[None, :], mask=(heads < 2 * H)[:, None], other=0.0)
    qd_cols = _split_cols(qd, SPLIT)
    lse = tl.load(lse_ptr + row * H + heads, mask=live, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + row * H + heads, mask=live, other=0.0)
    dq = tl.zeros([HB, D], tl.float32)
    for start in range(lo, hi, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < hi, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        x = _dot_kt(qd_cols, k, SPLIT, PREC)  # rows [0, H): q.k; [H, 2H): dO.k
        if PREC == "ieee":
            dp = tl.dot(down, x, input_precision=PREC)
        else:
            x_hi = x.to(k.dtype)
            dp = tl.dot(down, x_hi) + tl.dot(down, (x - x_hi.to(tl.float32)).to(k.dtype))
        # Rows past H (dO.k, zeros) are not heads: no probability, so no dS.
        p = tl.where(live[:, None] & valid[None, :], tl.exp2(x * scale_log2 - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        if DKV_OP != 0:
            stacked = (ds * scale + tl.dot(up, p.to(k.dtype), input_precision=PREC)).to(k.dtype)  # [dS * scale; P]
            dkv = tl.dot(tl.trans(stacked), qd, input_precision=PREC)
            _write_dkv(dkv_rows + j.to(tl.int64)[:, None] * D + d[None, :], dkv, valid, DKV_OP, RED)
    _write_dq(dq_ptr + offs, dq * scale, live[:, None], DQ_ATOMIC, RED)


@triton.jit
def _sparse_mla_bwd_row_slots(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi, hb,
             row0, seq_q, seq_kv, width, scale, scale_log2, H,
             HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, DC: tl.constexpr, DQ_ATOMIC: tl.constexpr,
             PREC: tl.constexpr, DKV_OP: tl.constexpr):
    """`_sparse_mla_bwd_row` with every product transposed: the BN slots (64 or more) are the rows
    and the few heads the columns, so that sm_90 runs them as warp-group MMAs (wgmma needs 64
    rows; the head-major form has HB = 16 rows, of which 4 are heads at glm53-mini, and runs as
    mma.sync). q and dO are held as [D, HB]; dq accumulates as dq^T; dkv is built DC columns at a
    time (a [BN, D] fp32 block would not fit in registers) and added as it is produced.

    Measured on the H200 (bench_sparse_attention.py probes, 128k x 4 heads, 2026-12-02): 298 ms
    at 4 warps, 515 at 8, against 277.5 for the head-major pass; without dkv 180 vs 164 ms. The
    builds use all 255 registers and spill (the [BN, 512] key block, the dq^T accumulator), so the
    other instruction does not pay; doing fewer products does (`_sparse_mla_bwd_row_packed`)."""
    heads = hb * HB + tl.arange(0, HB)
    live = heads < H
    d = tl.arange(0, D)
    batch = (row0 + row) // seq_q
    kv_rows = kv_ptr + batch * seq_kv * D
    dkv_rows = dkv_ptr + batch * seq_kv * D
    offs_t = (row * H + heads[None, :]) * D + d[:, None]
    q_t = tl.load(q_ptr + offs_t, mask=live[None, :], other=0.0)
    do_t = tl.load(do_ptr + offs_t, mask=live[None, :], other=0.0)
    lse = tl.load(lse_ptr + row * H + heads, mask=live, other=0.0) * _LOG2E
    delta = tl.load(delta_ptr + row * H + heads, mask=live, other=0.0)
    dq_t = tl.zeros([D, HB], tl.float32)
    for start in range(lo, hi, BN):
        slot = start + tl.arange(0, BN)
        j = tl.load(idx_ptr + row * width + slot, mask=slot < hi, other=-1)
        valid = (j >= 0) & (j < seq_kv)
        k = tl.load(kv_rows + j.to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(k, q_t, input_precision=PREC)  # [BN, HB]
        p = tl.where(valid[:, None] & live[None, :], tl.exp2(s * scale_log2 - lse[None, :]), 0.0)
        dp = tl.dot(k, do_t, input_precision=PREC)
        ds = p * (dp - delta[None, :])
        dq_t += tl.dot(tl.trans(k), ds.to(k.dtype), input_precision=PREC)
        if DKV_OP != 0:
            ds_scaled = (ds * scale).to(k.dtype)
            p_low = p.to(k.dtype)
            for c in range(0, D, DC):
                dc = c + tl.arange(0, DC)
                offs_c = (row * H + heads[:, None]) * D + dc[None, :]
                q_c = tl.load(q_ptr + offs_c, mask=live[:, None], other=0.0)
                do_c = tl.load(do_ptr + offs_c, mask=live[:, None], other=0.0)
                dkv = tl.dot(ds_scaled, q_c, input_precision=PREC)
                dkv += tl.dot(p_low, do_c, input_precision=PREC)
                _write_dkv(dkv_rows + j.to(tl.int64)[:, None] * D + dc[None, :], dkv, valid, DKV_OP, False)
    _write_dq(dq_ptr + offs_t, dq_t * scale, live[None, :], DQ_ATOMIC, False)


@triton.jit(do_not_specialize=["row0", "n_rows", "seq_q", "seq_kv", "width", "n_bounds", "H"])
def _sparse_mla_bwd_kernel(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, bounds_ptr,
                row0, n_rows, seq_q, seq_kv, width, n_bounds, scale, scale_log2, H,
                HB: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, N_HB: tl.constexpr,
                RANGED: tl.constexpr, ROWS: tl.constexpr, PREC: tl.constexpr, DKV_OP: tl.constexpr,
                SLOTS: tl.constexpr, DC: tl.constexpr, PACK: tl.constexpr, SPLIT: tl.constexpr, RED: tl.constexpr):
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
                        if SLOTS:
                            _sparse_mla_bwd_row_slots(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi, hb,
                                     row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, DC, True, PREC, DKV_OP)
                        elif PACK:
                            _sparse_mla_bwd_row_packed(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi,
                                     row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, True, PREC, DKV_OP, SPLIT, RED)
                        else:
                            _sparse_mla_bwd_row(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, row, lo, hi, hb,
                                     row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, True, PREC, DKV_OP, SPLIT, RED)
    elif SLOTS:
        _sparse_mla_bwd_row_slots(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, (pid // N_HB).to(tl.int64), 0, width,
                 pid % N_HB, row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, DC, False, PREC, DKV_OP)
    elif PACK:
        _sparse_mla_bwd_row_packed(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, pid.to(tl.int64), 0, width,
                 row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, False, PREC, DKV_OP, SPLIT, RED)
    else:
        _sparse_mla_bwd_row(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, (pid // N_HB).to(tl.int64), 0, width,
                 pid % N_HB, row0, seq_q, seq_kv, width, scale, scale_log2, H, HB, D, BN, False, PREC, DKV_OP, SPLIT, RED)


# ----------------------------------------------------------------------------- launchers
# Tensors are contiguous: q/out/dO/dq [R, H, D] (R = B*T rows), kv [B*S, D], idx [R, W],
# lse/Delta [R, H] fp32, dkv [B*S, D] fp32.


def check_split(config: Config, dim: int) -> None:
    """A split product needs D in slices of at least one tensor-core step (16 columns), and at least
    one slice per warp (Triton lays the warps along the product's batch: fewer slices than warps
    would repeat each slice's product on several warps); the slot-major backward has no split form."""
    if config.split_k > 1 and (dim % config.split_k or dim // config.split_k < 16):
        raise ValueError(f"{config.label()} splits {dim} latent columns into {config.split_k} slices: each must be "
                         "a whole number of at least 16 columns; use split_k 1 or a divisor of the width")
    if config.split_k > 1 and config.split_k < config.num_warps:
        raise ValueError(f"{config.label()} splits the latent into {config.split_k} slices for {config.num_warps} warps: "
                         "each slice's product would run on several warps; use split_k >= num_warps (or 1)")
    if config.split_k > 1 and config.slot_major:
        raise ValueError(f"{config.label()}: the slot-major backward has no split products; use split_k 1 or drop slot_major")


def red_available(*tensors: torch.Tensor) -> bool:
    """Whether the adds in the products' layout (`_red_add_pairs`, inline PTX) can run on these
    buffers: not in Triton's interpreter, which has no PTX (there the adds stay tl.atomic_add: the
    same sums), and only on 8-byte aligned buffers (the vector adds' alignment)."""
    return not triton.knobs.runtime.interpret and all(t.data_ptr() % 8 == 0 for t in tensors)


def forward(q, kv, idx, out, lse, *, row0: int, seq_q: int, seq_kv: int, scale: float, config: Config) -> None:
    """out and lse of the rows of this launch (per-row tensors start at row `row0` of [B*T])."""
    rows, heads, dim = q.shape
    n_hb = triton.cdiv(heads, config.head_block)
    check_split(config, dim)
    if rows == 0:
        return
    _sparse_mla_fwd_kernel[(rows * n_hb,)](q, kv, idx, out, lse, row0, seq_q, seq_kv, idx.shape[1], scale * LOG2E, heads,
                                HB=config.head_block, D=dim, BN=config.block_n, N_HB=n_hb, SPLIT=config.split_k,
                                PREC=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages)


def delta(out, dout, dst) -> None:
    rows, heads, dim = out.shape
    if rows:
        _sparse_mla_delta_kernel[(rows,)](out, dout, dst, heads, HP=triton.next_power_of_2(heads), D=dim, DC=min(dim, 128), num_warps=4)


def backward(q, kv, idx, dout, lse, dlt, dq, dkv, *, row0: int, seq_q: int, seq_kv: int, scale: float,
             config: Config, bounds=None, dkv_op: str = "add", pack: bool | None = None, red: bool = False) -> None:
    """dq and dkv (fp32, added to) for the rows of this launch; dq is stored (q's dtype) in one pass,
    added to (an fp32 buffer) with key chunks. `dkv_op` "skip" / "store" are the benchmark's probes
    (wrong dkv).

    `bounds` [rows, C + 1] int32: row r's slots of key chunk c are [bounds[r, c], bounds[r, c+1])
    of its (sorted) idx row; None: every slot in one pass. `pack` (None: `packs`) stacks q and dO
    into one operand where at most half the head block's rows are heads. `red` adds dkv and dq's
    partial sums in the products' layout, two columns an instruction (where `red_available`)."""
    rows, heads, dim = q.shape
    if pack and not packs(heads, config):
        raise ValueError(f"{heads} heads fill more than half of {config.label()}'s head block: the backward cannot pack them")
    check_split(config, dim)
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
                         RANGED=bounds is not None, ROWS=RANGED_ROWS, DKV_OP=DKV_OPS[dkv_op],
                         SLOTS=config.slot_major, DC=slot_columns(dim), PACK=packs(heads, config) if pack is None else pack,
                         SPLIT=config.split_k, RED=red and dim % 2 == 0 and red_available(dq, dkv),
                         PREC=dot_precision(q.dtype), num_warps=config.num_warps, num_stages=config.num_stages)


def aot_compile(kind: str, heads: int, dim: int, config: Config, *, ranged: bool = False, pack: bool | None = None,
                red: bool = False, arch: int = 90):
    """Compile "fwd" or "bwd" for a GPU architecture without a GPU, specialised as the JIT
    specialises a launch (genolong/kernels/aot.py): the CPU build check."""
    from genolong.kernels import aot

    meta = dict(HB=config.head_block, D=dim, BN=config.block_n, N_HB=triton.cdiv(heads, config.head_block), PREC="tf32",
                SPLIT=config.split_k)
    if kind == "fwd":
        fn = _sparse_mla_fwd_kernel
        args = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32", row0="i32",
                    seq_q="i32", seq_kv="i32", width="i32", scale_log2="fp32", H="i32")
    else:
        fn = _sparse_mla_bwd_kernel
        meta.update(RANGED=ranged, ROWS=RANGED_ROWS, DKV_OP=DKV_OPS["add"], SLOTS=config.slot_major, DC=slot_columns(dim),
                    PACK=packs(heads, config) if pack is None else pack, RED=red)
        args = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", do_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32",
                    dq_ptr="*fp32" if ranged else "*bf16", dkv_ptr="*fp32", bounds_ptr="*i32", row0="i32", n_rows="i32",
                    seq_q="i32", seq_kv="i32", width="i32", n_bounds="i32", scale="fp32", scale_log2="fp32", H="i32")
    return aot.build(fn, args, meta, num_warps=config.num_warps, num_stages=config.num_stages, arch=arch)
