"""The MoE combine without atomics: each token's k expert outputs, weighted by the router, summed.

The grouped path (moe/grouped.py) computes the experts' outputs in expert order and adds them back
to their tokens with a bf16 `index_add` — atomic adds to random rows (the 128k glm53-mini step
on the H200 spent 285 ms in 504 bf16 index_add kernels, profile of 2026-12-02; how much of it is the combine's was not separated), plus the fp32
product with the weights and its cast before it. Here the sum is read-side:

- forward: one program per (block of tokens, block of columns) reads, for each of the token's k
  slots, the row that slot's expert produced (through the inverse of the sort) and accumulates
  weight x row in fp32; one write per token, in the output's dtype. No atomics, no fp32 copy of
  the rows, the same result up to the order of k fp32 adds (the index_add sums the k bf16-rounded
  products in bf16, in expert order).
- backward: one program per block of rows (expert order) gathers the gradient of its slot's
  token: d row = weight x d y (each row written once: the sort is a permutation), and
  d weight = <d y, row> over the columns (one value per slot, written once).

The default since it was measured on the H200 (2026-12-02, benchmarks/bench_moe_combine.py:
glm53-mini's 128k tokens x top-4 forward + backward 0.69 ms against 7.61 ms for index_add, 3.0
GiB less peak; GLM-5.3-Flash's shape 4.8 vs 64.5 ms); GENOLONG_MOE_COMBINE=index_add selects
the old path. The CPU tests run it under Triton's interpreter against the index_add path
(tests/kernels/test_moe_combine.py).
"""

from __future__ import annotations


import torch

from genolong import switches

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BT, BD, BR = 16, 128, 32


ENV_COMBINE = "GENOLONG_MOE_COMBINE"
ENV_DISPATCH = "GENOLONG_MOE_DISPATCH"


def combine_mode() -> str:
    """"triton" (default: `combine`, the read-side sum) or "index_add" (`combine_index_add`)."""
    return switches.get(ENV_COMBINE)


def dispatch_mode() -> str:
    """"triton" (default: `dispatch`, the read-side backward) or "index" (`dispatch_index`, autograd's)."""
    return switches.get(ENV_DISPATCH)


if triton is not None:

    # D (the hidden size) is a compile-time constant: one build per model width, and the backward's
    # loop over column blocks has a fixed trip count (a runtime bound does not run in the interpreter).
    # UNWEIGHTED: the plain sum of the k rows (w_ptr unread): the dispatch's backward (_Dispatch).
    @triton.jit
    def _combine_fwd_kernel(out_ptr, inverse_ptr, w_ptr, y_ptr, n_tokens, D: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                            UNWEIGHTED: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        live = tok < n_tokens
        mask = live[:, None] & (cols < D)[None, :]
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for j in range(K):
            slot = tok.to(tl.int64) * K + j
            row = tl.load(inverse_ptr + slot, mask=live, other=0)
            v = tl.load(out_ptr + row[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if UNWEIGHTED:
                acc += v
            else:
                w = tl.load(w_ptr + slot, mask=live, other=0.0).to(tl.float32)
                acc += w[:, None] * v
        tl.store(y_ptr + tok[:, None].to(tl.int64) * D + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_bwd_kernel(out_ptr, order_ptr, w_ptr, dy_ptr, dout_ptr, dw_ptr, n_rows, D: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        live = r < n_rows
        slot = tl.load(order_ptr + r, mask=live, other=0)
        tok = slot // K
        w = tl.load(w_ptr + slot, mask=live, other=0.0).to(tl.float32)
        dot = tl.zeros([BR], dtype=tl.float32)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            mask = live[:, None] & (cols < D)[None, :]
            g = tl.load(dy_ptr + tok[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            o = tl.load(out_ptr + r[:, None].to(tl.int64) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(dout_ptr + r[:, None].to(tl.int64) * D + cols[None, :], (w[:, None] * g).to(dout_ptr.dtype.element_ty), mask=mask)
            dot += tl.sum(g * o, axis=1)
        tl.store(dw_ptr + slot, dot, mask=live)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The row of each slot: inverse[order[i]] = i (order is a permutation of the slots)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    return inverse


def _sum_rows(out: torch.Tensor, order: torch.Tensor, weight: torch.Tensor | None, k: int) -> torch.Tensor:
    """y[t] = sum_j w[t * k + j] * out[row of slot t * k + j] (w = 1 without `weight`), fp32 sums."""
    rows, hidden = out.shape
    n_tokens = rows // k
    out = out.contiguous()
    y = torch.empty(n_tokens, hidden, dtype=out.dtype, device=out.device)
    if n_tokens:
        grid = (triton.cdiv(n_tokens, BT), triton.cdiv(hidden, BD))
        w = out if weight is None else weight.contiguous()  # unread when unweighted
        _combine_fwd_kernel[grid](out, _inverse(order), w, y, n_tokens, D=hidden, K=k, BT=BT, BD=BD,
                                  UNWEIGHTED=weight is None, num_warps=4)
    return y


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, order, weight, k):
        out = out.contiguous()
        y = _sum_rows(out, order, weight, k)
        ctx.save_for_backward(out, order, weight)
        ctx.k = k
        return y

    @staticmethod
    def backward(ctx, dy):
        out, order, weight = ctx.saved_tensors
        rows, hidden = out.shape
        dout = torch.empty_like(out)
        dw = torch.empty(rows, dtype=torch.float32, device=out.device)
        if rows:
            _combine_bwd_kernel[(triton.cdiv(rows, BR),)](
                out, order, weight.contiguous(), dy.contiguous(), dout, dw, rows, D=hidden, K=ctx.k, BR=BR, BD=BD, num_warps=4
            )
        return dout, None, dw.to(weight.dtype), None


def combine(out: torch.Tensor, order: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """y [n, D]: y[t] = sum_j weight[t * k + j] * out[row of slot t * k + j].

    out [n * k, D]: the experts' outputs in expert order, row i from slot order[i] (= token * k + j,
    the stable argsort of the flattened top-k indices); weight [n * k]: the router's weights in slot
    order. Gradients flow to out and weight."""
    if triton is None:
        raise RuntimeError("the Triton MoE combine needs triton (the gpu extra)")
    return _Combine.apply(out, order, weight, k)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, k):
        ctx.k = k
        ctx.save_for_backward(order)
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, drows):
        (order,) = ctx.saved_tensors
        return _sum_rows(drows, order, None, ctx.k), None, None


def dispatch(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """rows [n * k, D]: rows[i] = x[order[i] // k], the tokens' rows in expert order (the combine's
    inverse). The same values as `x[order // k]`; its backward sums each token's k row gradients
    read-side, the combine's forward with unit weights (fp32 sums, one write per token), where
    autograd's index backward sorts the indices and accumulates them (on the H200 a 128k glm53-mini
    step: `indexing_backward_kernel` 30 ms in 168 calls plus its sorts)."""
    if triton is None:
        raise RuntimeError("the Triton MoE dispatch needs triton (the gpu extra)")
    return _Dispatch.apply(x, order, k)


def dispatch_index(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """`dispatch` by advanced indexing (autograd's index backward): the old path and the reference."""
    return x[order // k]


def combine_index_add(out: torch.Tensor, order: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """The same sum as the grouped path has always computed it (and as the model's reference does):
    bf16-rounded products added to their tokens with index_add."""
    token = order // k
    y = torch.zeros(out.shape[0] // k, out.shape[1], dtype=out.dtype, device=out.device)
    return y.index_add(0, token, (out * weight[order, None]).to(out.dtype))


def aot_compile(hidden: int = 512, k: int = 4, arch: int = 90) -> dict:
    """Both kernels built for sm_`arch` without a GPU (bf16 rows, fp32 weights; glm53-mini's width
    and top-k by default): {name: kernel}."""
    from genolong.kernels import aot

    fwd = {"out_ptr": "*bf16", "inverse_ptr": "*i64", "w_ptr": "*fp32", "y_ptr": "*bf16", "n_tokens": "i32"}
    bwd = {"out_ptr": "*bf16", "order_ptr": "*i64", "w_ptr": "*fp32", "dy_ptr": "*bf16", "dout_ptr": "*bf16",
           "dw_ptr": "*fp32", "n_rows": "i32"}
    return {
        "forward": aot.build(_combine_fwd_kernel, fwd, dict(D=hidden, K=k, BT=BT, BD=BD, UNWEIGHTED=False), num_warps=4, arch=arch),
        "dispatch backward": aot.build(_combine_fwd_kernel, fwd, dict(D=hidden, K=k, BT=BT, BD=BD, UNWEIGHTED=True), num_warps=4, arch=arch),
        "backward": aot.build(_combine_bwd_kernel, bwd, dict(D=hidden, K=k, BR=BR, BD=BD), num_warps=4, arch=arch),
    }
