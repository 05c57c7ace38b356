"""The MoE router's expert choice (top-k of a few dozen scores per token) as one Triton kernel.

In a 128k glm53-mini step the router's `torch.topk` (top 4 of 64 experts, 252 calls over the MoE
forwards and their recomputes) ran as PyTorch's radix-select kernel, `gatherTopK`: 59.9 ms of
GPU time for 32 MiB of scores a call (benchmarks/h200-2026-12-03-s18, ~140 GB/s). Here one
program takes a block of tokens, holds their scores in registers and takes the maximum k times:
one read of the scores, one write of the indices.

Selection: the k largest scores of each row, ties to the lower expert index, in descending
order of score. NaN counts as +inf (torch.topk ranks NaN above everything; a router that makes
NaN has already diverged). It is reached through the custom op `torch.ops.genolong.router_topk`,
which the compiled router (genolong/train/compile.py) calls unless GENOLONG_ROUTER_TOPK=torch;
off CUDA, or for shapes the kernel does not take, the op runs `torch.topk`. Checked in Triton's
interpreter, for sm_90 on the CPU and on an H100 against torch.topk (tests/gpu/test_fastops.py); the
default since 2026-12-05, when it and the indexer's narrow top-k took a 128k step from 6.50 to 6.31 s
on an H100.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from genolong import switches

ENV = "GENOLONG_ROUTER_TOPK"
MAX_EXPERTS = 1024  # one row's scores held in registers
MAX_K = 16


def setting() -> str:
    """GENOLONG_ROUTER_TOPK: "triton" (default; this kernel, on CUDA) or "torch" (torch.topk)."""
    return switches.get(ENV)


def unsupported(choice: torch.Tensor, k: int) -> str | None:
    """Why the kernel does not take these inputs (None: it does)."""
    if not choice.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "not a CUDA tensor"
    if choice.dim() != 2 or choice.dtype != torch.float32:
        return f"needs fp32 scores [tokens, experts], got {choice.dtype} {tuple(choice.shape)}"
    if not 0 < k <= min(MAX_K, choice.shape[1]) or choice.shape[1] > MAX_EXPERTS:
        return f"takes 1 <= k <= {MAX_K} of at most {MAX_EXPERTS} experts, got top {k} of {choice.shape[1]}"
    return None


def _rows_per_program(experts_padded: int) -> int:
    # ~4096 scores a program (32 per thread at 4 warps).
    return max(1, 4096 // experts_padded)


@triton.jit
def _router_topk_kernel(s_ptr, idx_ptr, n_rows, n_cols, stride_s,
                        K: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BE)
    live = rows < n_rows
    real = cols < n_cols
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_s + cols[None, :], mask=live[:, None] & real[None, :],
                other=float("-inf"))
    s = tl.where(s != s, float("inf"), s)
    # Taken columns (and the padding past n_cols) are out of every later round; a score of -inf
    # stays choosable, as in torch.topk, so a knocked-out column is marked, not set to -inf.
    out = tl.broadcast_to((~real)[None, :], (BR, BE))
    for j in tl.static_range(K):
        best = tl.max(tl.where(out, float("-inf"), s), axis=1)
        pick = tl.min(tl.where((s == best[:, None]) & ~out, cols[None, :], BE), axis=1)
        tl.store(idx_ptr + rows.to(tl.int64) * K + j, pick.to(tl.int64), mask=live)
        out = out | (cols[None, :] == pick[:, None])


def router_topk_triton(choice: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [tokens, k]: the k best experts of each row of fp32 `choice` [tokens, experts] (module docstring)."""
    why = unsupported(choice, k)
    if why is not None:
        from genolong.model.ops import KernelUnsupported

        raise KernelUnsupported(f"router top-k kernel: {why}")
    n, e = choice.shape
    idx = torch.empty((n, k), dtype=torch.int64, device=choice.device)
    if n == 0:
        return idx
    if choice.stride(1) != 1:
        choice = choice.contiguous()
    be = max(16, triton.next_power_of_2(e))
    br = _rows_per_program(be)
    _router_topk_kernel[(triton.cdiv(n, br),)](choice, idx, n, e, choice.stride(0), K=k, BR=br, BE=be, num_warps=4)
    return idx


@torch.library.custom_op("genolong::router_topk", mutates_args=())
def router_topk(choice: torch.Tensor, k: int) -> torch.Tensor:
    """The router's expert choice: this kernel where it runs, else torch.topk's indices."""
    if choice.is_cuda and unsupported(choice, k) is None:
        return router_topk_triton(choice, k)
    return choice.topk(k, dim=-1, sorted=False).indices


@router_topk.register_fake
def _(choice, k):
    return choice.new_empty((choice.shape[0], k), dtype=torch.int64)


def aot_compile(experts: int, k: int, arch: int = 90):
    """The kernel built for a GPU architecture without a GPU, as the JIT builds it (genolong.kernels.aot)."""
    from genolong.kernels import aot

    be = max(16, triton.next_power_of_2(experts))
    args = dict(s_ptr="*fp32", idx_ptr="*i64", n_rows="i32", n_cols=experts, stride_s=experts)
    return aot.build(_router_topk_kernel, args, dict(K=k, BR=_rows_per_program(be), BE=be), num_warps=4, arch=arch)
