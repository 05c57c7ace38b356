"""mHC's Sinkhorn normalisation as one Triton kernel per direction, and as a custom op for torch.compile.

Eager PyTorch runs `genolong.model.mhc_math.sinkhorn` (the reference) as ~120 tiny kernels per
sublayer over [T, n, n] fp32, and autograd keeps every one of the 39 intermediate matrices for
the backward. Here each program holds BT tokens' n x n matrices in registers:

- forward: the reference's order exactly (a column pass, then iters - 1 row + column passes);
- backward: only the input is saved. Half-step s of the forward is y = x / (sum(x) + eps) over
  rows or columns; its vector-Jacobian product is dx = (dy - sum(dy * y)) / (sum(x) + eps) over
  the same axis. One forward pass keeps each half-step's sums (a transient STEPS x n fp32 per
  token: 80 MiB at 128k tokens), then the half-steps run from the last to the first, each input
  rebuilt from its output (docs/kernels.md, "Fused mHC").

`torch.ops.genolong.mhc_sinkhorn` wraps both kernels with autograd; torch.compile sees it as one
opaque op. On CPU tensors the op runs the reference (the kernels run on the CPU only under
Triton's interpreter, which the tests use).
"""

from __future__ import annotations

import torch

from genolong.model.mhc_math import sinkhorn as sinkhorn_reference

BT = 128

try:
    import triton
    import triton.language as tl
except ImportError:  # the op then runs the reference; the fused path declines on the GPU
    triton = None


if triton is not None:

    @triton.jit
    def _normalise(x, step, eps):
        # Half-step `step`: even steps normalise columns (sum over rows i), odd steps rows.
        col = tl.sum(x, axis=1)[:, None, :]
        row = tl.sum(x, axis=2)[:, :, None]
        return x / (tl.where(step % 2 == 0, col, row) + eps)

    @triton.jit
    def _sinkhorn_fwd_kernel(x_ptr, y_ptr, n_tokens, eps, N: tl.constexpr, STEPS: tl.constexpr, BT: tl.constexpr):
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        i = tl.arange(0, N)
        offs = tok[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + i[None, None, :]
        live = (tok < n_tokens)[:, None, None]
        # Padding tokens are all ones (finite sums), then masked out of the store.
        x = tl.load(x_ptr + offs, mask=live, other=1.0)
        for s in range(STEPS):
            x = _normalise(x, s, eps)
        tl.store(y_ptr + offs, x, mask=live)

    @triton.jit
    def _sinkhorn_bwd_stored_kernel(
        x_ptr, dy_ptr, dx_ptr, tot_ptr, n_tokens, eps, N: tl.constexpr, STEPS: tl.constexpr, BT: tl.constexpr
    ):
        # O(steps): one forward pass that stores each half-step's sums + eps ([tokens, STEPS, N]
        # fp32, this program's rows only), then the half-steps from the last to the first, each
        # step's input rebuilt from its output as y * total (the exact inverse of y = x / total up
        # to one rounding per step) instead of recomputed from the saved matrix.
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        i = tl.arange(0, N)
        offs = tok[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + i[None, None, :]
        live = (tok < n_tokens)[:, None, None]
        toffs = tok[:, None].to(tl.int64) * (STEPS * N) + i[None, :]
        tlive = (tok < n_tokens)[:, None]
        x = tl.load(x_ptr + offs, mask=live, other=1.0)
        for s in range(STEPS):
            col = s % 2 == 0
            total = tl.where(col, tl.sum(x, axis=1), tl.sum(x, axis=2)) + eps  # [BT, N]: per column, or per row
            tl.store(tot_ptr + toffs + s * N, total, mask=tlive)
            x = x / tl.where(col, total[:, None, :], total[:, :, None])
        tl.debug_barrier()  # the sums stored by this program's threads, visible to all of them
        g = tl.load(dy_ptr + offs, mask=live, other=0.0)
        y = x
        for r in range(STEPS):
            s = STEPS - 1 - r
            col = s % 2 == 0
            total = tl.load(tot_ptr + toffs + s * N, mask=tlive, other=1.0)
            total = tl.where(col, total[:, None, :], total[:, :, None])
            gy = g * y
            g = (g - tl.where(col, tl.sum(gy, axis=1)[:, None, :], tl.sum(gy, axis=2)[:, :, None])) / total
            y = y * total
        tl.store(dx_ptr + offs, g, mask=live)


def steps(iters: int) -> int:
    """Half-steps of the reference: one column pass, then iters - 1 row + column passes."""
    return 2 * iters - 1


def _launch(kernel, *tensors, n: int, iters: int, eps: float) -> None:
    n_tokens = tensors[0].numel() // (n * n)
    if n_tokens:
        kernel[(triton.cdiv(n_tokens, BT),)](*tensors, n_tokens, float(eps), N=n, STEPS=steps(iters), BT=BT, num_warps=4)


def sinkhorn_forward(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Triton forward: fp32 [.., n, n] -> [.., n, n]."""
    x = comb.contiguous()
    y = torch.empty_like(x)
    _launch(_sinkhorn_fwd_kernel, x, y, n=x.shape[-1], iters=iters, eps=eps)
    return y


def sinkhorn_backward(comb: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Triton backward: the gradient with respect to the forward's input, from that input alone."""
    x, dy = comb.contiguous(), grad.contiguous().to(comb.dtype)
    dx = torch.empty_like(x)
    n = x.shape[-1]
    sums = torch.empty(x.numel() // (n * n), steps(iters), n, dtype=x.dtype, device=x.device)
    _launch(_sinkhorn_bwd_stored_kernel, x, dy, dx, sums, n=n, iters=iters, eps=eps)
    return dx


def supported(comb: torch.Tensor) -> str | None:
    """Why the kernels cannot run this input, or None."""
    if triton is None:
        return "triton is not importable"
    n = comb.shape[-1]
    if comb.shape[-2] != n or n & (n - 1) or n > 16:
        return f"square n x n matrices with n a power of two <= 16 only, got {tuple(comb.shape[-2:])}"
    if comb.dtype != torch.float32:
        return f"fp32 only, got {comb.dtype}"
    return None


def sinkhorn_backward_torch(comb: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The backward kernel's algorithm in PyTorch (the op's CPU path: autograd is off inside a custom op)."""
    inputs = [comb]
    for s in range(steps(iters) - 1):
        dim = -2 if s % 2 == 0 else -1
        inputs.append(inputs[-1] / (inputs[-1].sum(dim, keepdim=True) + eps))
    g = grad.to(comb.dtype)
    for s in reversed(range(steps(iters))):
        dim = -2 if s % 2 == 0 else -1
        total = inputs[s].sum(dim, keepdim=True) + eps
        g = (g - (g * inputs[s] / total).sum(dim, keepdim=True)) / total
    return g


@torch.library.custom_op("genolong::mhc_sinkhorn", mutates_args=())
def mhc_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if comb.is_cuda and supported(comb) is None:
        return sinkhorn_forward(comb, iters, eps)
    return sinkhorn_reference(comb, iters, eps).contiguous()


@torch.library.custom_op("genolong::mhc_sinkhorn_backward", mutates_args=())
def mhc_sinkhorn_backward(comb: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if comb.is_cuda and supported(comb) is None:
        return sinkhorn_backward(comb, grad, iters, eps)
    return sinkhorn_backward_torch(comb, grad, iters, eps).contiguous()


@mhc_sinkhorn.register_fake
def _(comb, iters, eps):
    return torch.empty_like(comb, memory_format=torch.contiguous_format)


@mhc_sinkhorn_backward.register_fake
def _(comb, grad, iters, eps):
    return torch.empty_like(comb, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    comb, iters, eps = inputs
    ctx.save_for_backward(comb)
    ctx.iters, ctx.eps = iters, eps


def _backward(ctx, grad):
    (comb,) = ctx.saved_tensors
    return mhc_sinkhorn_backward(comb, grad, ctx.iters, ctx.eps), None, None


mhc_sinkhorn.register_autograd(_backward, setup_context=_setup_context)


def aot_compile(n: int = 4, iters: int = 20, arch: int = 90) -> dict:
    """Both kernels built for a GPU architecture without a GPU (the CPU compile check), specialised
    as the JIT specialises their launches (genolong.kernels.aot): {name: kernel}."""
    from genolong.kernels import aot

    const = dict(N=n, STEPS=steps(iters), BT=BT)
    built = {}
    for name, kernel, ptrs in (("forward", _sinkhorn_fwd_kernel, ("x_ptr", "y_ptr")),
                               ("backward", _sinkhorn_bwd_stored_kernel, ("x_ptr", "dy_ptr", "dx_ptr", "tot_ptr"))):
        args = {**dict.fromkeys(ptrs, "*fp32"), "n_tokens": "i32", "eps": "fp32"}
        built[name] = aot.build(kernel, args, const, num_warps=4, arch=arch)
    return built
