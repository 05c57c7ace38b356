"""The two Triton passes of the fused indexer (see indexer_topk.py for the algorithm).

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
        c = i * BC + tl.arange(0, BC)
        cm = c < n_cand
        gi = tl.load(gidx_ptr + row * stride_gt + c // G, mask=cm, other=0)
        gv = tl.load(gval_ptr + row * stride_gt + c // G, mask=cm, other=float("-inf"))
        p = gi * G + c % G
        ok = cm & (gv > float("-inf")) & (p < n_pools) & ((p + 1) * KPOOL <= t + 1)
        k = tl.load(k_ptr + p[:, None] * stride_kp + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        sc = tl.sum(tl.maximum(s * scale, 0.0) * w[:, None], axis=0)
        tl.store(out_ptr + row * stride_ot + c, tl.where(ok, sc, float("-inf")), mask=cm)


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
    _group_max_kernel[grid](q, keys, w, out, n, int(t[0]), n_pools, n_groups, float(scale),
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
    _candidate_kernel[(n,)](q, keys, w, gidx, gval, out, int(t[0]), keys.shape[0], n_cand, float(scale),
                            q.stride(0), q.stride(1), keys.stride(0), w.stride(0), gidx.stride(0), out.stride(0),
                            KPOOL=kpool, H=heads, HP=_heads_padded(heads, 16), D=dim, G=group, BC=BC,
                            N_BLOCKS=triton.cdiv(n_cand, BC), num_warps=4)
    return out


def aot_compile(heads: int, dim: int, kpool: int, group: int, arch: int = 90) -> dict:
    """Compile both passes for a GPU architecture without a GPU (the CPU compile check): {name: kernel}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    ints = ("stride_qt", "stride_qh", "stride_kp", "stride_wt")
    hp = _heads_padded(heads, 1)
    sig1 = {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "n_rows": "i32", "t0": "i32",
            "n_pools": "i32", "n_groups": "i32", "scale": "fp32", **dict.fromkeys(ints, "i32"), "stride_ot": "i32"}
    const1 = dict(KPOOL=kpool, H=heads, HP=hp, D=dim, BM=block_queries(hp), BN=BN, G=group, N_INNER=N_INNER)
    sig2 = {"q_ptr": "*bf16", "k_ptr": "*bf16", "w_ptr": "*fp32", "gidx_ptr": "*i64", "gval_ptr": "*fp32", "out_ptr": "*fp32",
            "t0": "i32", "n_pools": "i32", "n_cand": "i32", "scale": "fp32", **dict.fromkeys(ints, "i32"),
            "stride_gt": "i32", "stride_ot": "i32"}
    const2 = dict(KPOOL=kpool, H=heads, HP=_heads_padded(heads, 16), D=dim, G=group, BC=BC, N_BLOCKS=512 * group // BC)
    return {
        "group_max": triton.compile(ASTSource(_group_max_kernel, {**sig1, **dict.fromkeys(const1, "constexpr")}, const1),
                                    target=target, options={"num_warps": 8, "num_stages": 2}),
        "candidate_scores": triton.compile(ASTSource(_candidate_kernel, {**sig2, **dict.fromkeys(const2, "constexpr")}, const2),
                                           target=target, options={"num_warps": 4}),
    }
