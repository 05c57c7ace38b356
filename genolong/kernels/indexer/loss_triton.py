"""The three Triton kernels of the fused "dsa_indexer_loss" (driven by genolong/kernels/indexer/loss.py).

Per chunk of queries, with only [chunk x selected pools] fp32 buffers in between (never a
[chunk x W x latent] gather, never [T x T]):
1. `_pool_mass_kernel`, one program per (query, block of pools): gathers the block's selected
   latents, rebuilds the attention probabilities exp(scale q.kv - lse) for all heads from the
   sparse attention's log-sum-exp, and sums them over heads and over each pool's tokens;
2. `_index_logits_kernel`, one program per (query, block of pools): the indexer scores
   sum_h w[h] relu(scale iq[h].K[pool]) of the selected pools;
3. in PyTorch on the [chunk, S] buffers: target (normalised mass), log-softmax, KL, and
   dKL/dlogits = softmax - target (times grad_scale);
4. `_index_backward_kernel`, one program per query: recomputes the scores, accumulates the
   query's d_index_q and d_head_weights in registers and adds its d_pool_keys contributions
   with fp32 atomics (so d_pool_keys' summation order, and its last bits, vary run to run).

Runs on the CPU under TRITON_INTERPRET=1 (tests/kernels/test_indexer_loss.py) with fp16/fp32
inputs; on the GPU with bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl

KEYS_PER_BLOCK = 64  # selected tokens per mass program (pools per program: this // kpool)
POOLS_PER_BLOCK = 64  # selected pools per logits / backward block
LATENT_BLOCK = 128


@triton.jit
def _pool_mass_kernel(q_ptr, kv_ptr, idx_ptr, lse_ptr, out_ptr, n_sel, dim, scale,
                      stride_qt, stride_qh, stride_kv, stride_it, stride_lt, stride_ot,
                      H: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BD: tl.constexpr,
                      KPOOL: tl.constexpr, BK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    slot = blk * BK + tl.arange(0, BK)
    idx = tl.load(idx_ptr + row * stride_it + slot, mask=slot < n_sel * KPOOL, other=-1)
    valid = idx >= 0
    h = tl.arange(0, HP)
    live = h < H
    lse = tl.load(lse_ptr + row * stride_lt + h, mask=live, other=0.0)
    acc = tl.zeros((HP, BK), dtype=tl.float32)
    for d0 in range(0, DP, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < dim
        q = tl.load(q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        kv = tl.load(kv_ptr + idx[:, None].to(tl.int64) * stride_kv + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        acc += tl.dot(q, tl.trans(kv))
    # A row without keys has lse -inf and no valid slot: the where, not a product, keeps it 0.
    p = tl.where(live[:, None] & valid[None, :], tl.exp(acc * scale - lse[:, None]), 0.0)
    mass = tl.sum(tl.reshape(tl.sum(p, axis=0), (BK // KPOOL, KPOOL)), axis=1)
    pool = blk * (BK // KPOOL) + tl.arange(0, BK // KPOOL)
    tl.store(out_ptr + row * stride_ot + pool, mass, mask=pool < n_sel)


@triton.jit
def _load_pool_block(iq_ptr, pk_ptr, w_ptr, idx_ptr, row, blk, n_sel, dim, stride_qt, stride_qh, stride_pk, stride_wt, stride_it,
                     HI: tl.constexpr, HIP: tl.constexpr, DIP: tl.constexpr, KPOOL: tl.constexpr, BS: tl.constexpr):
    """A query's index_q [HIP, DIP], head weights [HIP], and the keys [BS, DIP] of pool block `blk`."""
    h = tl.arange(0, HIP)
    d = tl.arange(0, DIP)
    dm = d < dim
    iq = tl.load(iq_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :], mask=(h < HI)[:, None] & dm[None, :], other=0.0)
    w = tl.load(w_ptr + row * stride_wt + h, mask=h < HI, other=0.0)
    s = blk * BS + tl.arange(0, BS)
    # Any token of a selected pool names it: token // kpool.
    first = tl.load(idx_ptr + row * stride_it + s * KPOOL, mask=s < n_sel, other=-1)
    valid = first >= 0
    pool = tl.where(valid, first // KPOOL, 0).to(tl.int64)
    k = tl.load(pk_ptr + pool[:, None] * stride_pk + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
    return iq, w, k, s, valid, pool, d, dm


@triton.jit
def _index_logits_kernel(iq_ptr, pk_ptr, w_ptr, idx_ptr, out_ptr, n_sel, dim, index_scale,
                         stride_qt, stride_qh, stride_pk, stride_wt, stride_it, stride_ot,
                         HI: tl.constexpr, HIP: tl.constexpr, DIP: tl.constexpr, KPOOL: tl.constexpr, BS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    iq, w, k, s, valid, pool, d, dm = _load_pool_block(iq_ptr, pk_ptr, w_ptr, idx_ptr, row, blk, n_sel, dim, stride_qt, stride_qh,
                                                       stride_pk, stride_wt, stride_it, HI, HIP, DIP, KPOOL, BS)
    sc = tl.dot(iq, tl.trans(k)) * index_scale
    logits = tl.sum(tl.maximum(sc, 0.0) * w[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + s, logits, mask=s < n_sel)


@triton.jit
def _index_backward_kernel(iq_ptr, pk_ptr, w_ptr, idx_ptr, dl_ptr, diq_ptr, dpk_ptr, dw_ptr, n_sel, dim, index_scale,
                           stride_qt, stride_qh, stride_pk, stride_wt, stride_it, stride_dt,
                           HI: tl.constexpr, HIP: tl.constexpr, DIP: tl.constexpr, KPOOL: tl.constexpr, BS: tl.constexpr,
                           N_BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HIP)
    diq = tl.zeros((HIP, DIP), dtype=tl.float32)
    dw = tl.zeros((HIP,), dtype=tl.float32)
    for blk in range(N_BLOCKS):
        iq, w, k, s, valid, pool, d, dm = _load_pool_block(iq_ptr, pk_ptr, w_ptr, idx_ptr, row, blk, n_sel, dim, stride_qt, stride_qh,
                                                           stride_pk, stride_wt, stride_it, HI, HIP, DIP, KPOOL, BS)
        sc = tl.dot(iq, tl.trans(k)) * index_scale
        dl = tl.load(dl_ptr + row * stride_dt + s, mask=valid, other=0.0)
        dw += tl.sum(tl.maximum(sc, 0.0) * dl[None, :], axis=1)
        g = tl.where(sc > 0, dl[None, :] * w[:, None] * index_scale, 0.0)  # d loss / d (iq . K), fp32
        diq += tl.dot(g, k.to(tl.float32))
        dk = tl.dot(tl.trans(g), iq.to(tl.float32))
        tl.atomic_add(dpk_ptr + pool[:, None] * DIP + d[None, :], dk, mask=valid[:, None] & dm[None, :])
    d = tl.arange(0, DIP)
    tl.store(diq_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :], diq.to(diq_ptr.dtype.element_ty),
             mask=(h < HI)[:, None] & (d < dim)[None, :])
    tl.store(dw_ptr + row * stride_wt + h, dw, mask=h < HI)


def _pow2(x: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(x))


def pool_mass(q, kv, indices, lse, out, *, kpool: int, scale: float) -> None:
    """q [n,H,Dl], kv [S_kv,Dl], indices [n,W] int32, lse [n,H] fp32 -> out [n,S] fp32 (S = out.shape[1])."""
    n, heads, latent = q.shape
    sel = out.shape[1]
    dp = _pow2(latent, 16)
    _pool_mass_kernel[(n, triton.cdiv(sel * kpool, KEYS_PER_BLOCK))](
        q, kv, indices, lse, out, sel, latent, float(scale),
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), lse.stride(0), out.stride(0),
        H=heads, HP=_pow2(heads, 16), DP=dp, BD=min(LATENT_BLOCK, dp), KPOOL=kpool, BK=KEYS_PER_BLOCK, num_warps=4)


def _index_args(index_q, pool_keys, head_weights, indices, kpool):
    heads, dim = index_q.shape[1:]
    strides = (index_q.stride(0), index_q.stride(1), pool_keys.stride(0), head_weights.stride(0), indices.stride(0))
    consts = dict(HI=heads, HIP=_pow2(heads, 16), DIP=padded_dim(dim), KPOOL=kpool, BS=POOLS_PER_BLOCK)
    return dim, strides, consts


def padded_dim(index_dim: int) -> int:
    """The column count of the d_pool_keys accumulator `index_backward` adds into."""
    return _pow2(index_dim, 16)


def index_logits(index_q, pool_keys, head_weights, indices, out, *, kpool: int, index_scale: float) -> None:
    """index_q [n,Hi,Di], pool_keys [P,Di], head_weights [n,Hi] fp32, indices [n,W] -> out [n,S] fp32."""
    n, sel = out.shape
    dim, strides, consts = _index_args(index_q, pool_keys, head_weights, indices, kpool)
    _index_logits_kernel[(n, triton.cdiv(sel, POOLS_PER_BLOCK))](
        index_q, pool_keys, head_weights, indices, out, sel, dim, float(index_scale), *strides, out.stride(0), **consts, num_warps=4)


def index_backward(index_q, pool_keys, head_weights, indices, dlogits, d_index_q, d_pool_keys, d_head_weights, *, kpool: int,
                   index_scale: float) -> None:
    """dlogits [n,S] fp32 -> d_index_q [n,Hi,Di] (written; index_q's strides), d_head_weights [n,Hi] fp32
    (written), d_pool_keys fp32 [P, padded_dim(Di)] (added to)."""
    n, sel = dlogits.shape
    dim, strides, consts = _index_args(index_q, pool_keys, head_weights, indices, kpool)
    _index_backward_kernel[(n,)](
        index_q, pool_keys, head_weights, indices, dlogits, d_index_q, d_pool_keys, d_head_weights, sel, dim, float(index_scale),
        *strides, dlogits.stride(0), **consts, N_BLOCKS=triton.cdiv(sel, POOLS_PER_BLOCK), num_warps=4)


def aot_compile(heads: int, latent: int, index_heads: int, index_dim: int, kpool: int, topk_pools: int, arch: int = 90) -> dict:
    """Compile the three kernels for a GPU architecture without a GPU (the CPU compile check), bf16
    inputs, specialised as the JIT specialises their launches (genolong.kernels.aot): {name: compiled kernel}."""
    from genolong.kernels import aot

    dp = _pow2(latent, 16)
    mass_sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "lse_ptr": "*fp32", "out_ptr": "*fp32", "n_sel": "i32",
                "dim": "i32", "scale": "fp32", **dict.fromkeys(("stride_qt", "stride_qh", "stride_kv", "stride_it", "stride_lt", "stride_ot"), "i32")}
    mass_const = dict(H=heads, HP=_pow2(heads, 16), DP=dp, BD=min(LATENT_BLOCK, dp), KPOOL=kpool, BK=KEYS_PER_BLOCK)
    strides = dict.fromkeys(("stride_qt", "stride_qh", "stride_pk", "stride_wt", "stride_it"), "i32")
    index_const = dict(HI=index_heads, HIP=_pow2(index_heads, 16), DIP=padded_dim(index_dim), KPOOL=kpool, BS=POOLS_PER_BLOCK)
    logits_sig = {"iq_ptr": "*bf16", "pk_ptr": "*bf16", "w_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*fp32", "n_sel": "i32",
                  "dim": "i32", "index_scale": "fp32", **strides, "stride_ot": "i32"}
    backward_sig = {"iq_ptr": "*bf16", "pk_ptr": "*bf16", "w_ptr": "*fp32", "idx_ptr": "*i32", "dl_ptr": "*fp32", "diq_ptr": "*bf16",
                    "dpk_ptr": "*fp32", "dw_ptr": "*fp32", "n_sel": "i32", "dim": "i32", "index_scale": "fp32", **strides, "stride_dt": "i32"}
    backward_const = {**index_const, "N_BLOCKS": triton.cdiv(topk_pools, POOLS_PER_BLOCK)}
    builds = {
        "pool_mass": (_pool_mass_kernel, mass_sig, mass_const),
        "index_logits": (_index_logits_kernel, logits_sig, index_const),
        "index_backward": (_index_backward_kernel, backward_sig, backward_const),
    }
    return {
        name: aot.build(fn, sig, const, num_warps=4, arch=arch)
        for name, (fn, sig, const) in builds.items()
    }
