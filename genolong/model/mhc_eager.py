"""Faster eager versions of mHC's per-token math; the references are in genolong/model/mhc_math.py.

The references run as thousands of tiny operations over [T, n, n] and [T]-batched 1 x n and
n x n matrix products, which cost 25-35% of a `tiny` step on the CPU (measured 2026-12-01):

- `sinkhorn`: one autograd node instead of ~80 (the reference's 2 * iters - 1 divisions and
  sums). The matrices are laid out tokens-last ([n, n, tokens], a reduction over rows or
  columns is then a sum of contiguous vectors, ~8x faster than over the last two axes) and
  normalised without autograd; each half-step's output and denominator are kept, and the
  backward walks the half-steps in reverse: for y = x / (sum(x) + eps) over one axis,
  dx = (dy - sum(dy * y)) / (sum(x) + eps) over the same axis. The same arithmetic in the
  same order as the reference forward (only the sums' rounding may differ); saved memory as
  autograd's for the reference.
- `collapse`: a broadcast multiply and a sum over the streams instead of a [T]-batched
  1 x n product (~3x cheaper with its backward); fp32 and fp64 streams only: for bf16 the
  reference's product accumulates in fp32, which a bf16 multiply-sum would not.

- `expand`: one autograd node whose backward is two [T]-batched n x n products with
  contiguous operands and two multiply-sums, instead of autograd's chain through transposes,
  broadcasts and a [T]-batched product of a transposed matrix (~4x cheaper fwd+bwd at 2k
  tokens); fp32 and fp64 only, like `collapse`.

tests/model/test_mhc_eager.py compares values and float64 gradients with the references.
"""

from __future__ import annotations

import torch

from genolong.model import mhc_math


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        n = comb.shape[-1]
        x = comb.detach().reshape(-1, n, n).permute(1, 2, 0).contiguous()  # [n (rows i), n (columns o), tokens]
        steps = 2 * iters - 1
        ys = torch.empty((steps, *x.shape), dtype=x.dtype, device=x.device)
        totals = []
        for s in range(steps):
            # Even half-steps normalise columns (a sum over the rows, axis 0), odd ones rows.
            total = x.sum(dim=s % 2, keepdim=True) + eps
            x = torch.div(x, total, out=ys[s])
            totals.append(total)
        ctx.save_for_backward(ys, *totals)
        ctx.shape = comb.shape
        # A copy in the caller's layout, not a view of the saved tensors.
        return x.permute(2, 0, 1).contiguous().reshape(comb.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        ys, *totals = ctx.saved_tensors
        n = ctx.shape[-1]
        g = grad.reshape(-1, n, n).permute(1, 2, 0).contiguous()
        for s in range(len(totals) - 1, -1, -1):
            axis = s % 2
            g = (g - (g * ys[s]).sum(dim=axis, keepdim=True)) / totals[s]
        return g.permute(2, 0, 1).contiguous().reshape(ctx.shape), None, None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`genolong.model.mhc_math.sinkhorn` (same result up to the rounding of 4-term sums), faster."""
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1, got {iters}; the config validation requires a positive count")
    return _Sinkhorn.apply(comb, iters, eps)


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """`genolong.model.mhc_math.collapse`: sum_i pre[i] * streams[i] (fp32, fp64 as a multiply-sum)."""
    if streams.dtype not in (torch.float32, torch.float64):
        return mhc_math.collapse(pre, streams)
    return (pre.unsqueeze(-1) * streams).sum(dim=-2)


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post, comb, out, residual):
        # new[o] = post[o] * out + sum_i comb[i, o] * residual[i]
        new = torch.matmul(comb.transpose(-1, -2), residual)
        new += post.unsqueeze(-1) * out.unsqueeze(-2)
        ctx.save_for_backward(post, comb, out, residual)
        return new

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        post, comb, out, residual = ctx.saved_tensors
        grad = grad.contiguous()
        d_post = (grad * out.unsqueeze(-2)).sum(-1) if ctx.needs_input_grad[0] else None
        d_comb = torch.matmul(residual, grad.transpose(-1, -2)) if ctx.needs_input_grad[1] else None  # [i, o]: residual[i] . grad[o]
        d_out = (grad * post.unsqueeze(-1)).sum(-2) if ctx.needs_input_grad[2] else None
        d_residual = torch.matmul(comb, grad) if ctx.needs_input_grad[3] else None
        return d_post, d_comb, d_out, d_residual


def expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`genolong.model.mhc_math.expand`: post[o] * out + sum_i comb[i, o] * residual[i] (fp32, fp64 as one node)."""
    dtype = residual.dtype
    if dtype not in (torch.float32, torch.float64):
        return mhc_math.expand(post, comb, out, residual)
    return _Expand.apply(post.to(dtype), comb.to(dtype), out.to(dtype), residual)
