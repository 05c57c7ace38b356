"""mHC around a sublayer as six Triton passes over the streams instead of dozens of PyTorch ops.

Eager PyTorch runs one mHC sublayer as a dozen kernels over the [T, n, D] streams forward (the
RMS statistic, the 24-column projection, [T]-batched 1 x n and n x n products, broadcasts and
adds) and about twice that backward; at the real model's width (hidden 4096) a layer's two
sublayers took 386 ms forward + backward at 128k tokens on the H200, 2 TFLOP/s
(2026-12-01). The work is memory-bound: each pass here reads the streams once.

Forward (`mix_collapse`, `expand`):
1. `_mix_logits_kernel`: per token the sum of squares (fp32) and the (2 + n) n logits
   x . fn^T (one tensor-core product per block, accumulated in fp32 and rounded to the
   streams' dtype as the reference's linear output is), and rstd = rsqrt(mean square + eps).
   The logits' pointwise tail (sigmoids, softmax, Sinkhorn: [T, 24] numbers) stays in PyTorch
   with the Triton Sinkhorn (genolong/kernels/mhc/sinkhorn.py): it is 1/170 of the streams.
2. `_collapse_kernel`: the sublayer's input sum_i pre[i] x[i] (fp32 accumulation).
3. `_expand_kernel`: new[o] = post[o] out + sum_i comb[i, o] residual[i].
Backward:
4. `_collapse_dpre_kernel`: d pre[i] = sum_d dy . x[i] (the one reduction the tail needs).
   The tail's backward is PyTorch autograd over the [T, 24] numbers, recomputed from the saved
   raw logits and rstd (no other intermediate is kept).
5. `_mix_collapse_dx_kernel`: dx[i] = pre[i] dy + d_raw . fn[:, i] + c x[i], where the last term
   is the RMS statistic's (c = -d_rstd rstd^3 / (n D)); the gradient of fn is one cuBLAS
   product d_raw^T x over the tokens (a reduction across blocks).
6. `_expand_bwd_kernel`: d out, d residual, and the per-token reductions d post and d comb.

The references are genolong/model/mhc.py's op functions (the ops "mhc_mix_collapse" and
"mhc_expand", built on genolong/model/mhc_math.py); tests/kernels/test_mhc_fused.py runs these
kernels in Triton's interpreter against them and builds them for sm_90, tests/gpu/test_mhc_fused.py
compares them on the GPU.
"""

from __future__ import annotations

import torch

from genolong.model import mhc_math
from genolong.model.ops import KernelUnsupported

try:
    import triton
    import triton.language as tl
except ImportError:  # the ops then decline (KernelUnsupported) and the reference runs
    triton = None

# Block sizes: tokens x hidden columns per program (see docs/kernels.md, "Fused mHC"). The two
# passes with a tensor-core product take smaller blocks for fp32 streams: fp32 products run
# without tensor cores and spill registers at 64 x 64 (ptxas, tests/kernels/test_mhc_fused.py).
DOT_BLOCKS = {"16-bit": (64, 64), "fp32": (32, 32)}
COLLAPSE_BT, COLLAPSE_BD = 32, 128
DPRE_BT, DPRE_BD = 16, 128
EXPAND_BT, EXPAND_BD = 16, 128
EXPAND_BWD_BT, EXPAND_BWD_BD = 8, 128


if triton is not None:

    @triton.jit
    def _mix_logits_kernel(x_ptr, w_ptr, raw_ptr, rstd_ptr, n_tokens, rms_eps, D: tl.constexpr,
                           N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                           PRECISION: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        live = tok < n_tokens
        row = tok.to(tl.int64) * (N * D)
        kk = tl.arange(0, KP)
        acc = tl.zeros([BT, KP], dtype=tl.float32)
        squares = tl.zeros([BT], dtype=tl.float32)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            dm = dd < D
            for i in tl.static_range(N):
                x = tl.load(x_ptr + row[:, None] + i * D + dd[None, :], mask=live[:, None] & dm[None, :], other=0.0)
                xf = x.to(tl.float32)
                squares += tl.sum(xf * xf, axis=1)
                # fn is [K, N * D] row-major: its columns i * D + dd, transposed to [BD, KP].
                w = tl.load(w_ptr + kk[None, :] * (N * D) + i * D + dd[:, None], mask=(kk < K)[None, :] & dm[:, None], other=0.0)
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
        raw = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference's linear output is in the streams' dtype
        rstd = tl.rsqrt(squares / (N * D) + rms_eps)
        tl.store(raw_ptr + tok[:, None] * K + kk[None, :], raw, mask=live[:, None] & (kk < K)[None, :])
        tl.store(rstd_ptr + tok, rstd, mask=live)

    @triton.jit
    def _collapse_kernel(x_ptr, pre_ptr, y_ptr, n_tokens, D: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        dd = tl.program_id(1) * BD + tl.arange(0, BD)
        live = tok < n_tokens
        mask = live[:, None] & (dd < D)[None, :]
        row = tok.to(tl.int64) * (N * D)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for i in tl.static_range(N):
            # pre rounded to the streams' dtype first, as the reference's product takes it.
            p = tl.load(pre_ptr + tok * N + i, mask=live, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)
            x = tl.load(x_ptr + row[:, None] + i * D + dd[None, :], mask=mask, other=0.0)
            acc += p[:, None] * x.to(tl.float32)
        tl.store(y_ptr + tok.to(tl.int64)[:, None] * D + dd[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _collapse_dpre_kernel(x_ptr, dy_ptr, dpre_ptr, n_tokens, D: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        live = tok < n_tokens
        ii = tl.arange(0, N)
        row = tok.to(tl.int64) * (N * D)
        acc = tl.zeros([BT, N], dtype=tl.float32)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            mask = live[:, None] & (dd < D)[None, :]
            dy = tl.load(dy_ptr + tok.to(tl.int64)[:, None] * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + row[:, None, None] + ii[None, :, None] * D + dd[None, None, :], mask=mask[:, None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32) * dy[:, None, :], axis=2)
        tl.store(dpre_ptr + tok[:, None] * N + ii[None, :], acc, mask=live[:, None])

    @triton.jit
    def _mix_collapse_dx_kernel(x_ptr, dy_ptr, pre_ptr, draw_ptr, coef_ptr, w_ptr, dx_ptr, n_tokens, D: tl.constexpr,
                                N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                                PRECISION: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        dd = tl.program_id(1) * BD + tl.arange(0, BD)
        live = tok < n_tokens
        dm = dd < D
        mask = live[:, None] & dm[None, :]
        kk = tl.arange(0, KP)
        row = tok.to(tl.int64) * (N * D)
        # The logits' gradient in the streams' dtype, as the reference's linear backward takes it.
        draw = tl.load(draw_ptr + tok[:, None] * K + kk[None, :], mask=live[:, None] & (kk < K)[None, :], other=0.0)
        draw = draw.to(x_ptr.dtype.element_ty)
        coef = tl.load(coef_ptr + tok, mask=live, other=0.0)
        dy = tl.load(dy_ptr + tok.to(tl.int64)[:, None] * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(N):
            w = tl.load(w_ptr + kk[:, None] * (N * D) + i * D + dd[None, :], mask=(kk < K)[:, None] & dm[None, :], other=0.0)
            g = tl.dot(draw, w, input_precision=PRECISION)
            x = tl.load(x_ptr + row[:, None] + i * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            p = tl.load(pre_ptr + tok * N + i, mask=live, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
            g += coef[:, None] * x + p[:, None] * dy
            tl.store(dx_ptr + row[:, None] + i * D + dd[None, :], g.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _expand_kernel(post_ptr, comb_ptr, out_ptr, res_ptr, new_ptr, n_tokens, D: tl.constexpr,
                       N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        dd = tl.program_id(1) * BD + tl.arange(0, BD)
        live = tok < n_tokens
        mask = live[:, None] & (dd < D)[None, :]
        oo = tl.arange(0, N)
        row = tok.to(tl.int64) * (N * D)
        dtype = new_ptr.dtype.element_ty
        post = tl.load(post_ptr + tok[:, None] * N + oo[None, :], mask=live[:, None], other=0.0)
        out = tl.load(out_ptr + tok.to(tl.int64)[:, None] * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = post[:, :, None] * out[:, None, :]
        for i in tl.static_range(N):
            c = tl.load(comb_ptr + tok[:, None] * (N * N) + i * N + oo[None, :], mask=live[:, None], other=0.0)  # comb[i, :]
            r = tl.load(res_ptr + row[:, None] + i * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += c[:, :, None] * r[:, None, :]
        tl.store(new_ptr + row[:, None, None] + oo[None, :, None] * D + dd[None, None, :], acc.to(dtype), mask=mask[:, None, :])

    @triton.jit
    def _expand_bwd_kernel(post_ptr, comb_ptr, out_ptr, res_ptr, g_ptr, dout_ptr, dres_ptr, dpost_ptr, dcomb_ptr,
                           n_tokens, D: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        live = tok < n_tokens
        ii = tl.arange(0, N)
        row = tok.to(tl.int64) * (N * D)
        post = tl.load(post_ptr + tok[:, None] * N + ii[None, :], mask=live[:, None], other=0.0)
        comb = tl.load(comb_ptr + tok[:, None, None] * (N * N) + ii[None, :, None] * N + ii[None, None, :],
                       mask=live[:, None, None], other=0.0)  # [BT, i, o]
        d_post = tl.zeros([BT, N], dtype=tl.float32)
        d_comb = tl.zeros([BT, N, N], dtype=tl.float32)
        for d0 in range(0, D, BD):
            dd = d0 + tl.arange(0, BD)
            mask = live[:, None] & (dd < D)[None, :]
            g = tl.load(g_ptr + row[:, None, None] + ii[None, :, None] * D + dd[None, None, :], mask=mask[:, None, :],
                        other=0.0).to(tl.float32)  # [BT, o, BD]
            out = tl.load(out_ptr + tok.to(tl.int64)[:, None] * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
            d_post += tl.sum(g * out[:, None, :], axis=2)
            d_out = tl.sum(post[:, :, None] * g, axis=1)
            tl.store(dout_ptr + tok.to(tl.int64)[:, None] * D + dd[None, :], d_out.to(dout_ptr.dtype.element_ty), mask=mask)
            for i in tl.static_range(N):
                r = tl.load(res_ptr + row[:, None] + i * D + dd[None, :], mask=mask, other=0.0).to(tl.float32)
                d_comb += tl.where(ii[None, :, None] == i, tl.sum(r[:, None, :] * g, axis=2)[:, None, :], 0.0)
                c = tl.sum(tl.where(ii[None, :, None] == i, comb, 0.0), axis=1)  # comb[i, :], [BT, o]
                d_res = tl.sum(c[:, :, None] * g, axis=1)
                tl.store(dres_ptr + row[:, None] + i * D + dd[None, :], d_res.to(dres_ptr.dtype.element_ty), mask=mask)
        tl.store(dpost_ptr + tok[:, None] * N + ii[None, :], d_post, mask=live[:, None])
        tl.store(dcomb_ptr + tok[:, None, None] * (N * N) + ii[None, :, None] * N + ii[None, None, :], d_comb,
                 mask=live[:, None, None])


def padded_logits(n: int) -> int:
    """The logits' column count (2 + n) n rounded up to a power of two >= 16 (a tensor-core tile)."""
    return max(16, triton.next_power_of_2((2 + n) * n))


def _precision(dtype: torch.dtype) -> str:
    # fp32 streams get fp32 products (tf32 would lose ~3 digits against the reference).
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(tokens, hidden columns) per program of the two passes with a tensor-core product."""
    return DOT_BLOCKS["fp32" if dtype == torch.float32 else "16-bit"]


def mix_logits_stages(n: int) -> int | None:
    """Pipeline stages of the logits pass: Triton's default (None: 3) up to 4 streams, the build
    measured on the H200. At 8 streams each stage holds a [BD, 8 x 80] block of fn: 3 stages ask
    for 524,288 bytes of shared memory (327,680 in fp32; an sm_90 block may have 232,448) and the
    launch fails; one stage needs 24,576 (sm_90 builds, 2026-12-05)."""
    return None if n <= 4 else 1


def mix_logits(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, n, D], fn [(2 + n) n, n D] in x's dtype -> (raw logits fp32 [T, (2 + n) n], rstd fp32 [T])."""
    t, n, d = x.shape
    k = fn.shape[0]
    raw = torch.empty(t, k, device=x.device, dtype=torch.float32)
    rstd = torch.empty(t, device=x.device, dtype=torch.float32)
    bt, bd = dot_blocks(x.dtype)
    if t:
        stages = mix_logits_stages(n)
        _mix_logits_kernel[(triton.cdiv(t, bt),)](x, fn, raw, rstd, t, float(rms_eps), D=d, N=n, K=k, KP=padded_logits(n),
                                             BT=bt, BD=bd, PRECISION=_precision(x.dtype), num_warps=4,
                                             **({} if stages is None else {"num_stages": stages}))
    return raw, rstd


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [T, n, D], pre fp32 [T, n] -> sum_i pre[i] x[i], [T, D] in x's dtype."""
    t, n, d = x.shape
    y = torch.empty(t, d, device=x.device, dtype=x.dtype)
    if t:
        _collapse_kernel[(triton.cdiv(t, COLLAPSE_BT), triton.cdiv(d, COLLAPSE_BD))](x, pre, y, t, D=d, N=n, BT=COLLAPSE_BT,
                                                                          BD=COLLAPSE_BD, num_warps=4)
    return y


def collapse_dpre(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """d pre fp32 [T, n] = sum_d dy . x[i] for x [T, n, D], dy [T, D]."""
    t, n, d = x.shape
    dpre = torch.empty(t, n, device=x.device, dtype=torch.float32)
    if t:
        _collapse_dpre_kernel[(triton.cdiv(t, DPRE_BT),)](x, dy, dpre, t, D=d, N=n, BT=DPRE_BT, BD=DPRE_BD, num_warps=8)
    return dpre


def mix_collapse_dx(x, dy, pre, d_raw, coef, fn) -> torch.Tensor:
    """dx [T, n, D] of the collapse and the logits together (module docstring, pass 5)."""
    t, n, d = x.shape
    k = fn.shape[0]
    dx = torch.empty_like(x)
    bt, bd = dot_blocks(x.dtype)
    if t:
        _mix_collapse_dx_kernel[(triton.cdiv(t, bt), triton.cdiv(d, bd))](
            x, dy, pre, d_raw, coef, fn, dx, t, D=d, N=n, K=k, KP=padded_logits(n), BT=bt, BD=bd,
            PRECISION=_precision(x.dtype), num_warps=4)
    return dx


def expand_forward(post, comb, out, residual) -> torch.Tensor:
    """post fp32 [T, n], comb fp32 [T, n, n], out [T, D], residual [T, n, D] -> new streams [T, n, D]."""
    t, n, d = residual.shape
    new = torch.empty_like(residual)
    if t:
        _expand_kernel[(triton.cdiv(t, EXPAND_BT), triton.cdiv(d, EXPAND_BD))](post, comb, out, residual, new, t, D=d, N=n,
                                                                    BT=EXPAND_BT, BD=EXPAND_BD, num_warps=8)
    return new


def expand_backward(post, comb, out, residual, grad):
    """(d post fp32, d comb fp32, d out, d residual) of `expand_forward` for the gradient `grad`."""
    t, n, d = residual.shape
    d_out, d_res = torch.empty_like(out), torch.empty_like(residual)
    d_post = torch.empty(t, n, device=grad.device, dtype=torch.float32)
    d_comb = torch.empty(t, n, n, device=grad.device, dtype=torch.float32)
    if t:
        _expand_bwd_kernel[(triton.cdiv(t, EXPAND_BWD_BT),)](post, comb, out, residual, grad, d_out, d_res, d_post, d_comb, t, D=d,
                                                        N=n, BT=EXPAND_BWD_BT, BD=EXPAND_BWD_BD, num_warps=4)
    return d_post, d_comb, d_out, d_res


# ----------------------------------------------------------------------------- autograd

def _tail(raw, rstd, base, scale, n: int, iters: int, eps: float):
    """pre, post and Sinkhorn'd comb from the raw logits: the reference's own pointwise code."""
    from genolong.kernels.mhc import sinkhorn as mhc_sinkhorn  # noqa: F401  (registers torch.ops.genolong.mhc_sinkhorn)

    pre, post, comb = mhc_math.mix_from_logits(raw * rstd[:, None], base, scale, n=n, eps=eps)
    return pre, post, torch.ops.genolong.mhc_sinkhorn(comb.contiguous(), iters, eps)


class _MixCollapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, n, iters, eps, rms_eps):
        w = fn.to(x.dtype).contiguous()
        raw, rstd = mix_logits(x, w, rms_eps)
        pre, post, comb = _tail(raw, rstd, base, scale, n, iters, eps)
        y = collapse(x, pre)
        ctx.save_for_backward(x, w, raw, rstd, base, scale, pre)
        ctx.n, ctx.iters, ctx.eps, ctx.fn_dtype = n, iters, eps, fn.dtype
        return post, comb, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_post, d_comb, dy):
        x, w, raw, rstd, base, scale, pre = ctx.saved_tensors
        t, n, d = x.shape
        dy = torch.zeros(t, d, device=x.device, dtype=x.dtype) if dy is None else dy.contiguous().to(x.dtype)
        d_pre = collapse_dpre(x, dy)
        # The tail's backward: autograd over [T, 24] numbers, recomputed from raw and rstd.
        with torch.enable_grad():
            leaves = [t_.detach().requires_grad_() for t_ in (raw, rstd, base, scale)]
            outs = _tail(*leaves, ctx.n, ctx.iters, ctx.eps)
            pairs = [(o, g) for o, g in zip(outs, (d_pre, d_post, d_comb)) if g is not None]
            d_raw, d_rstd, d_base, d_scale = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                                                 allow_unused=True)
        d_raw = torch.zeros_like(raw) if d_raw is None else d_raw.contiguous()
        # d rstd / d x[j] = -rstd^3 x[j] / (n D): the RMS statistic's share of dx is c x.
        coef = (-d_rstd * rstd.pow(3) / (n * d)).contiguous() if d_rstd is not None else torch.zeros_like(rstd)
        dx = mix_collapse_dx(x, dy, pre, d_raw, coef, w)
        d_fn = (d_raw.to(x.dtype).t() @ x.reshape(t, n * d)).to(ctx.fn_dtype) if ctx.needs_input_grad[1] else None
        return dx, d_fn, d_base, d_scale, None, None, None, None


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post, comb, out, residual):
        ctx.save_for_backward(post, comb, out, residual)
        return expand_forward(post, comb, out, residual)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        post, comb, out, residual = ctx.saved_tensors
        return expand_backward(post, comb, out, residual, grad.contiguous())


# ----------------------------------------------------------------------------- the registered ops

def _decline(streams: torch.Tensor, n: int) -> str | None:
    if triton is None:
        return "triton is not importable"
    if n & (n - 1) or n > 8:
        return f"a power-of-two stream count <= 8 only, got {n}"
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"streams in bf16, fp16 or fp32 only, got {streams.dtype}"
    if not streams.is_cuda:
        return "the fused mHC runs on CUDA tensors only"
    return None


def mhc_mix_collapse_fused(streams, fn, base, scale, *, n: int, iters: int, eps: float, rms_eps: float):
    """The op "mhc_mix_collapse" (reference: genolong.model.mhc.mix_collapse_reference), fused."""
    why = _decline(streams, n)
    if why:
        raise KernelUnsupported(why)
    lead, hidden = streams.shape[:-2], streams.shape[-1]
    post, comb, y = _MixCollapse.apply(streams.reshape(-1, n, hidden).contiguous(), fn, base, scale, n, iters, eps, rms_eps)
    return post.reshape(*lead, n), comb.reshape(*lead, n, n), y.reshape(*lead, hidden)


def mhc_expand_fused(post, comb, out, residual):
    """The op "mhc_expand" (reference: genolong.model.mhc.expand_reference), fused."""
    n, hidden = residual.shape[-2:]
    why = _decline(residual, n)
    if why:
        raise KernelUnsupported(why)
    lead = residual.shape[:-2]
    new = _Expand.apply(post.reshape(-1, n).float().contiguous(), comb.reshape(-1, n, n).float().contiguous(),
                        out.reshape(-1, hidden).to(residual.dtype).contiguous(), residual.reshape(-1, n, hidden).contiguous())
    return new.reshape(*lead, n, hidden)


def aot_compile(n: int = 4, hidden: int = 1024, dtype: str = "bf16", arch: int = 90) -> dict:
    """Every kernel built for sm_`arch` without a GPU, specialised as the JIT specialises its launches
    (genolong.kernels.aot): {name: kernel}."""
    from genolong.kernels import aot

    k, kp = (2 + n) * n, padded_logits(n)
    x, f = f"*{dtype}", "*fp32"
    prec = "ieee" if dtype == "fp32" else "tf32"
    bt, bd = DOT_BLOCKS["fp32" if dtype == "fp32" else "16-bit"]
    shape = {"n_tokens": "i32"}
    specs = {
        "mix_logits": (_mix_logits_kernel, dict(x_ptr=x, w_ptr=x, raw_ptr=f, rstd_ptr=f, **shape, rms_eps="fp32"),
                       dict(D=hidden, N=n, K=k, KP=kp, BT=bt, BD=bd, PRECISION=prec), 4),
        "collapse": (_collapse_kernel, dict(x_ptr=x, pre_ptr=f, y_ptr=x, **shape), dict(D=hidden, N=n, BT=COLLAPSE_BT, BD=COLLAPSE_BD), 4),
        "collapse_dpre": (_collapse_dpre_kernel, dict(x_ptr=x, dy_ptr=x, dpre_ptr=f, **shape), dict(D=hidden, N=n, BT=DPRE_BT, BD=DPRE_BD), 8),
        "mix_collapse_dx": (_mix_collapse_dx_kernel, dict(x_ptr=x, dy_ptr=x, pre_ptr=f, draw_ptr=f, coef_ptr=f, w_ptr=x,
                                                          dx_ptr=x, **shape),
                            dict(D=hidden, N=n, K=k, KP=kp, BT=bt, BD=bd, PRECISION=prec), 4),
        "expand": (_expand_kernel, dict(post_ptr=f, comb_ptr=f, out_ptr=x, res_ptr=x, new_ptr=x, **shape),
                   dict(D=hidden, N=n, BT=EXPAND_BT, BD=EXPAND_BD), 8),
        "expand_bwd": (_expand_bwd_kernel, dict(post_ptr=f, comb_ptr=f, out_ptr=x, res_ptr=x, g_ptr=x, dout_ptr=x, dres_ptr=x,
                                                dpost_ptr=f, dcomb_ptr=f, **shape),
                       dict(D=hidden, N=n, BT=EXPAND_BWD_BT, BD=EXPAND_BWD_BD), 4),
    }
    stages = {"mix_logits": mix_logits_stages(n)}
    return {name: aot.build(kernel, args, const, num_warps=warps, num_stages=stages.get(name), arch=arch)
            for name, (kernel, args, const, warps) in specs.items()}
