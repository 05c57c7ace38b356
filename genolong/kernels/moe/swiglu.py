"""The MoE experts' clamped SwiGLU as one Triton pass forward and one backward.

The grouped path (moe/grouped.py) runs h = silu(min(gate, L)) * clamp(up, -L, L) on the gate/up
product [rows, 2I] of every chunk (rows = tokens x top-k). Eager, that is four kernels forward
(two clamps, silu, the product; each result rounded to bf16 and written) and autograd's chain of
about a dozen backward (the clamps' masks, silu's backward, the product's two sides, the two
halves' gradients concatenated into [rows, 2I]), and autograd saves four [rows, I] tensors. Under
full recompute the forward runs twice a step. Here:

- forward: one program per (block of rows, block of columns) reads gate and up once, computes in
  fp32 and writes h in the input's dtype (one rounding instead of four);
- backward: reads gate, up and dh once and writes d gate_up [rows, 2I] directly, both halves;
  the gradient passes where torch.clamp passes it (min <= x <= max, the bounds included);
- saved for the backward: the gate/up product alone (which the product's own backward keeps).

NaN propagates as in torch.clamp. The default since it was measured on the H200 (2026-12-02,
benchmarks/bench_swiglu.py: glm53-mini's 128k tokens x top-4, forward + backward 0.61 ms against
3.58 ms eager, peak 0.75 vs 1.5 GiB; GLM-5.3-Flash's 64k x top-8 x 2048 4.3 vs 30.8 ms);
GENOLONG_MOE_SWIGLU=eager selects the PyTorch expression. CPU tests run it under Triton's
interpreter against autograd of the eager expression (tests/kernels/test_swiglu_triton.py).
"""

from __future__ import annotations

import torch

from genolong import switches

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ENV_MODE = "GENOLONG_MOE_SWIGLU"
BR, BC = 32, 128  # rows x columns per program: 4 K elements, 16 per thread at 4 warps


def swiglu_mode() -> str:
    return switches.get(ENV_MODE)


if triton is not None:

    @triton.jit
    def _clamped(g, u, limit):
        gc = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        uc = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
        return gc, uc

    # I (the expert width) is a compile-time constant: the gate and up halves of a row are I apart.
    @triton.jit
    def _block(n_rows, I: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """This program's block: (offsets into [rows, 2I] of its gate elements, into [rows, I], mask)."""
        rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
        return rows[:, None] * (2 * I) + cols[None, :], rows[:, None] * I + cols[None, :], mask

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, h_ptr, n_rows, limit, I: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        at, out, mask = _block(n_rows, I, BR, BC)
        g = tl.load(gu_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + at + I, mask=mask, other=0.0).to(tl.float32)
        gc, uc = _clamped(g, u, limit)
        h = gc * tl.sigmoid(gc) * uc
        tl.store(h_ptr + out, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, n_rows, limit, I: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        at, out, mask = _block(n_rows, I, BR, BC)
        g = tl.load(gu_ptr + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + at + I, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + out, mask=mask, other=0.0).to(tl.float32)
        gc, uc = _clamped(g, u, limit)
        sig = tl.sigmoid(gc)
        silu = gc * sig
        # d silu(x) / dx = sig(x) (1 + x (1 - sig(x))); torch.clamp passes the gradient where
        # min <= x <= max (comparisons with NaN are false: no gradient, as in torch).
        dg = tl.where(g <= limit, dh * uc * sig * (1.0 + gc * (1.0 - sig)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dh * silu, 0.0)
        tl.store(dgu_ptr + at, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + at + I, du.to(dgu_ptr.dtype.element_ty), mask=mask)


def _grid(rows: int, inter: int) -> tuple[int, int]:
    return (triton.cdiv(rows, BR), triton.cdiv(inter, BC))


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, limit):
        gate_up = gate_up.contiguous()
        rows, two_inter = gate_up.shape
        inter = two_inter // 2
        h = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows and inter:
            _swiglu_fwd_kernel[_grid(rows, inter)](gate_up, h, rows, limit, I=inter, BR=BR, BC=BC, num_warps=4)
        ctx.save_for_backward(gate_up)
        ctx.limit = limit
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        rows, two_inter = gate_up.shape
        dgu = torch.empty_like(gate_up)
        if rows and two_inter:
            _swiglu_bwd_kernel[_grid(rows, two_inter // 2)](gate_up, dh.contiguous(), dgu, rows, ctx.limit, I=two_inter // 2,
                                                            BR=BR, BC=BC, num_warps=4)
        return dgu, None


def clamped_swiglu_packed(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """h [rows, I] = silu(min(gate, limit)) * clamp(up, -limit, limit) for gate_up [rows, 2I] =
    [gate | up] (the grouped GEMM's output): the eager expression of genolong.model.mlp.clamped_swiglu
    on the two halves, fused. Gradients flow to gate_up."""
    if triton is None:
        raise RuntimeError("the Triton SwiGLU needs triton (the gpu extra)")
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * inter], got {tuple(gate_up.shape)}")
    return _ClampedSwiGLU.apply(gate_up, float(limit))


def aot_compile(inter: int = 256, arch: int = 90) -> dict:
    """Both kernels built for sm_`arch` without a GPU (bf16; glm53-mini's expert width by default)."""
    from genolong.kernels import aot

    fwd = {"gu_ptr": "*bf16", "h_ptr": "*bf16", "n_rows": "i32", "limit": "fp32"}
    bwd = {"gu_ptr": "*bf16", "dh_ptr": "*bf16", "dgu_ptr": "*bf16", "n_rows": "i32", "limit": "fp32"}
    meta = dict(I=inter, BR=BR, BC=BC)
    return {
        "forward": aot.build(_swiglu_fwd_kernel, fwd, meta, num_warps=4, arch=arch),
        "backward": aot.build(_swiglu_bwd_kernel, bwd, meta, num_warps=4, arch=arch),
    }
