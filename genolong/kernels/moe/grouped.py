"""MoE experts as two grouped GEMMs (`torch._grouped_mm`), processed in chunks of tokens.

Per chunk, the (token, expert) pairs are sorted by expert; the chunk's gathered rows then go
through one grouped GEMM for gate/up and one for down, with the per-expert row offsets as the
group boundaries, and are added back to their tokens weighted by the router. A chunk holds at
most `chunk_tokens * k` rows whatever the routing, so a skewed router (real data: the busiest
expert sees several times the mean) cannot make a transient larger than the chunk's.
"""

from __future__ import annotations

import torch

from genolong.kernels import _common
from genolong.kernels.moe import combine as moe_combine_triton
from genolong.kernels.moe import swiglu as swiglu_triton
from genolong.kernels.moe.combine import combine_index_add, dispatch_index
from genolong.model.mlp import clamped_swiglu
from genolong.model.ops import KernelUnsupported

CHUNK_BUDGET_BYTES = 1 << 30


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[e-1]:offs[e]] times b[e] for each expert e: [M, K] x [E, K, N] -> [M, N]."""
    return torch._grouped_mm(a, b, offs=offs)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The same product as a loop of matmuls (the CPU tests' stand-in)."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(a[start:end] @ b[e])
        start = end
    return torch.cat(out, 0)


def expert_offsets(experts_sorted: torch.Tensor, n_experts: int) -> torch.Tensor:
    """int32 [E]: where each expert's rows end in the expert-sorted pairs (the grouped GEMM's `offs`).

    A search in the sorted experts rather than `cumsum(bincount(...))`: on CUDA bincount reads the
    input's max back to size its output, a host sync per chunk, in the forward and again in the
    recompute (~1,000 a 128k step of glm53-mini on the H200), each draining the launch queue."""
    bounds = torch.arange(n_experts, device=experts_sorted.device, dtype=experts_sorted.dtype)
    return torch.searchsorted(experts_sorted, bounds, right=True).to(torch.int32)


def chunk_tokens_for(k: int, hidden: int, inter: int, itemsize: int, budget_bytes: int = CHUNK_BUDGET_BYTES) -> int:
    # Gathered rows, gate/up, activation, down output (x dtype) and the fp32 weighted copy.
    per_token = k * (itemsize * (hidden + 2 * inter + inter + hidden) + 4 * hidden)
    return max(1, budget_bytes // per_token)


def swiglu_eager(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """The model's clamped SwiGLU on the [gate | up] halves of the grouped GEMM's output."""
    return clamped_swiglu(*gate_up.chunk(2, dim=-1), limit)


def sort_keys(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The expert indices as the narrowest integers that hold them, for the sort: a radix sort makes
    one pass per 8 key bits, so int16 keys take 2 passes where the router's int64 take 8."""
    if n_experts <= torch.iinfo(torch.int16).max:
        return flat.to(torch.int16)
    return flat.to(torch.int32)


def experts_grouped(x, topk_idx, topk_w, gate_up_proj, down_proj, *, swiglu_limit, chunk_tokens=None, mm=grouped_mm,
                    combine=combine_index_add, swiglu=swiglu_eager, dispatch=dispatch_index):
    """combine(out, order, weight, k): the weighted sum back to the tokens (moe/combine.py);
    swiglu(gate_up, limit): the activation on [gate | up] (moe/swiglu.py fuses it);
    dispatch(x, order, k): the tokens' rows in expert order (moe_combine_triton.dispatch: a read-side backward)."""
    n_tokens, k = topk_idx.shape
    n_experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(k, hidden, inter, x.element_size())
    w_gate_up = gate_up_proj.transpose(1, 2)  # [E, D, 2I], a view
    w_down = down_proj.transpose(1, 2)  # [E, I, D]
    outputs = []
    for n0 in range(0, n_tokens, chunk_tokens):
        idx = topk_idx[n0 : n0 + chunk_tokens]
        flat = idx.reshape(-1)
        experts_sorted, order = torch.sort(sort_keys(flat, n_experts), stable=True)
        offs = expert_offsets(experts_sorted, n_experts)
        rows = dispatch(x[n0 : n0 + chunk_tokens], order, k)
        h = swiglu(mm(rows, w_gate_up, offs), swiglu_limit)
        out = mm(h, w_down, offs)
        outputs.append(combine(out, order, topk_w[n0 : n0 + chunk_tokens].reshape(-1), k))
    return torch.cat(outputs, 0) if len(outputs) != 1 else outputs[0]


def moe_experts_grouped(x, topk_idx, topk_w, gate_up_proj, down_proj, *, swiglu_limit):
    """The "moe_experts" op (docs/ops.md) on torch._grouped_mm (CUDA, bf16, Hopper)."""
    _common.require_cuda(x, topk_idx, topk_w, gate_up_proj, down_proj)
    for name, t in (("x", x), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        _common.require_dtype(name, t, torch.bfloat16)
    if not hasattr(torch, "_grouped_mm"):
        raise KernelUnsupported("this torch has no torch._grouped_mm")
    major, _ = torch.cuda.get_device_capability(x.device)
    if major < 9:
        raise KernelUnsupported(f"torch._grouped_mm needs compute capability >= 9.0, got {major}.x")
    _, two_inter, hidden = gate_up_proj.shape
    if hidden % 8 or two_inter % 16:
        raise KernelUnsupported(f"grouped GEMM needs 16-byte aligned rows: hidden {hidden}, 2*inter {two_inter}")
    combine = moe_combine_triton.combine if moe_combine_triton.combine_mode() == "triton" else combine_index_add
    swiglu = swiglu_triton.clamped_swiglu_packed if swiglu_triton.swiglu_mode() == "triton" else swiglu_eager
    dispatch = moe_combine_triton.dispatch if moe_combine_triton.dispatch_mode() == "triton" else dispatch_index
    return experts_grouped(x, topk_idx, topk_w, gate_up_proj, down_proj, swiglu_limit=swiglu_limit, combine=combine,
                           swiglu=swiglu, dispatch=dispatch)
