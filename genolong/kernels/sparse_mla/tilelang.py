"""DSA sparse attention on megatron-core's TileLang sparse-MLA kernels, padded to their shapes.

The kernels (megatron/core/transformer/experimental_attention_variant/ops/, megatron-core 0.19.2)
are specialised to DeepSeek-V3.2: q and kv 576 wide (512 latent + 64 rope), values the first 512
columns, top-k a multiple of 64 (the backward: 32). GLM-5.3's NoPE latent is 512 wide and a query
selects up to 2051 keys. What was read in the kernel source, and what the padding relies on:

- An index slot is *skipped* only when it equals -1 exactly (`mask = idx != -1`); any other
  value is attended: a different negative loads row max(idx, 0) = row 0, an index past the end
  loads a zero row (the copy is predicated) that still takes part in the softmax with score 0.
  So -1, the contract's "no key" value, is the one neutral padding index. A query whose slots
  are all -1 gets output 0 and lse 0 (no division by a zero denominator), and the backward adds
  nothing for -1 slots (`if idx >= 0` around its atomic adds).
- q and kv get 64 zero columns: the extra q.k term is 0, the output (first 512 columns of the
  selected rows) is unchanged, and the gradients of the padded columns are dropped.
- Heads: the kernel pads the head count to max(next power of two, 16) itself and predicates
  every load and store of the padded heads (the generated CUDA guards them; the compile test
  checks it), so 4 heads need no copy. More than 64 heads must be a multiple of 64.
- All offsets in the generated code are 64-bit, so 1M-token inputs do not overflow; queries
  are still processed in chunks sized from a memory budget, to bound the padded copies.
- The forward's lse is base 2 (log2 of the sum of exp, the scale folded with log2(e)) and 0 for
  a row without keys (its max starts at -2^30, its sum stays 0, `log2` is skipped). The op's
  `return_lse` wants natural log and -inf there: `natural_lse` converts.

`Backend` is the pair of kernel calls; `emulated_backend()` is the same contract in plain
PyTorch (documenting the semantics above), which lets the padding, chunking and gradient
plumbing of `dsa_sparse_attention` be tested on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from genolong.kernels import _common
from genolong.model.ops import KernelUnsupported

KERNEL_DIM = 576
VALUE_DIM = 512
TAIL_DIM = KERNEL_DIM - VALUE_DIM
PAD_INDEX = -1
TOPK_MULTIPLE = 64
SEQ_BUCKET = 256
QUERY_BUDGET_BYTES = 2 << 30
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class Backend:
    """fwd(q576, kv576, idx, scale) -> (out [B,T,H,512], lse [B,T,H]);
    bwd(q576, kv576, out, dout, idx, lse, scale) -> (dq576, dkv576 [B,S,1,576])."""

    name: str
    fwd: Callable
    bwd: Callable


def megatron_backend() -> Backend:
    try:
        from megatron.core.transformer.experimental_attention_variant.ops import (
            tilelang_sparse_mla_bwd as mbwd,
        )
        from megatron.core.transformer.experimental_attention_variant.ops import (
            tilelang_sparse_mla_fwd as mfwd,
        )
    except Exception as why:  # ImportError, or a broken tilelang/CUDA install underneath
        raise KernelUnsupported(f"megatron-core's TileLang sparse-MLA kernels are not importable: {why}") from why
    if not (mfwd.HAVE_TILELANG and mbwd.HAVE_TILELANG):
        raise KernelUnsupported("tilelang is not installed")

    def fwd(q, kv, idx, scale):
        return mfwd.sparse_mla_fwd_interface(q, kv, idx, sm_scale=scale, d_v=VALUE_DIM)

    def bwd(q, kv, out, dout, idx, lse, scale):
        delta = mbwd.sparse_mla_delta(out, dout)
        return mbwd.sparse_mla_bwd(q, kv, None, dout, idx, lse, sm_scale=scale, delta=delta)

    return Backend("megatron-tilelang", fwd, bwd)


def _emulated_forward(q, kv, idx, scale):
    batch, seq, heads, _ = q.shape
    kv_rows = kv.shape[1]
    out = q.new_zeros(batch, seq, heads, VALUE_DIM, dtype=torch.float32)
    lse = q.new_zeros(batch, seq, heads, dtype=torch.float32)
    for b in range(batch):
        slots = idx[b, :, 0].long()  # [T, W]
        valid = slots != -1  # the kernel's test, literally
        live = valid.any(-1).nonzero().squeeze(-1)  # rows with no valid slot stay 0 (no compute needed)
        if live.numel() == 0:
            continue
        slots, valid = slots[live], valid[live]
        rows = slots.clamp(min=0)  # max(idx, 0): any other negative reads row 0
        in_range = (rows < kv_rows).unsqueeze(-1)  # past the end: the predicated copy leaves zeros
        keys = kv[b, rows.clamp(max=kv_rows - 1), 0].float() * in_range  # [n, W, 576]
        scores = torch.einsum("nhd,nwd->nhw", q[b, live].float(), keys) * scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = (scores - m).exp()
        denom = p.sum(-1, keepdim=True)
        out[b, live] = torch.einsum("nhw,nwd->nhd", p, keys[..., :VALUE_DIM]) / denom
        lse[b, live] = (denom.log2() + m * LOG2E).squeeze(-1)
    return out, lse


def emulated_backend() -> Backend:
    """The kernels' contract in fp32 PyTorch (small sizes only): the CPU tests' stand-in."""

    def fwd(q, kv, idx, scale):
        out, lse = _emulated_forward(q, kv, idx, scale)
        return out.to(q.dtype), lse

    def bwd(q, kv, out, dout, idx, lse, scale):
        with torch.enable_grad():
            qf = q.detach().float().requires_grad_()
            kvf = kv.detach().float().requires_grad_()
            o, _ = _emulated_forward(qf, kvf, idx, scale)
            dq, dkv = torch.autograd.grad(o, (qf, kvf), dout.float())
        return dq.to(q.dtype), dkv.to(kv.dtype)

    return Backend("emulated", fwd, bwd)


def check_supported(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> None:
    if q.ndim != 4 or kv.ndim != 3 or indices.ndim != 3:
        raise KernelUnsupported(f"expects q [B,T,H,D], kv [B,S,D], indices [B,T,W]; got {q.shape}, {kv.shape}, {indices.shape}")
    if q.shape[-1] != VALUE_DIM or kv.shape[-1] != VALUE_DIM:
        raise KernelUnsupported(f"the kernel's latent/value width is {VALUE_DIM}; got q {q.shape[-1]}, kv {kv.shape[-1]}")
    if q.shape[:2] != indices.shape[:2] or kv.shape[0] != q.shape[0]:
        raise KernelUnsupported(f"batch/length mismatch: q {q.shape}, kv {kv.shape}, indices {indices.shape}")
    heads = q.shape[2]
    if heads > 64 and heads % 64:
        raise KernelUnsupported(f"more than 64 heads must be a multiple of 64, got {heads}")
    _common.require_dtype("q", q, torch.bfloat16)
    _common.require_dtype("kv", kv, torch.bfloat16)
    _common.require_dtype("indices", indices, torch.int32)


def query_chunk(heads: int, width: int, budget_bytes: int = QUERY_BUDGET_BYTES) -> int:
    """Queries per kernel call: the padded copies of one chunk (q, indices, out, dout, dq) fit the budget."""
    per_query = heads * (KERNEL_DIM * 2 * 2 + VALUE_DIM * 2 * 3) + _common.round_up(width, TOPK_MULTIPLE) * 4 + heads * 8
    return max(SEQ_BUCKET, budget_bytes // per_query // SEQ_BUCKET * SEQ_BUCKET)


def _pad_kv(kv: torch.Tensor) -> torch.Tensor:
    batch, seq, _ = kv.shape
    out = kv.new_zeros(batch, _common.round_up(seq, SEQ_BUCKET), 1, KERNEL_DIM)
    out[:, :seq, 0, :VALUE_DIM] = kv
    return out


def _pad_rows(x: torch.Tensor, t0: int, t1: int, rows: int, width: int, fill: float) -> torch.Tensor:
    """x[:, t0:t1] copied into a [B, rows, ...] buffer whose last dim is `width`, padded with `fill`."""
    shape = (x.shape[0], rows, *x.shape[2:-1], width)
    out = x.new_full(shape, fill)
    out[:, : t1 - t0, ..., : x.shape[-1]] = x[:, t0:t1]
    return out


def _chunk_inputs(q, indices, t0, t1):
    rows = _common.round_up(t1 - t0, SEQ_BUCKET)
    q576 = _pad_rows(q, t0, t1, rows, KERNEL_DIM, 0.0)
    width = _common.round_up(indices.shape[-1], TOPK_MULTIPLE)
    idx = _pad_rows(indices.unsqueeze(2), t0, t1, rows, width, PAD_INDEX)
    return q576, idx, rows


class _PaddedSparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale, backend, chunk, return_lse):
        batch, seq, heads, _ = q.shape
        kv576 = _pad_kv(kv)
        out = _common.empty((batch, seq, heads, VALUE_DIM), dtype=q.dtype, device=q.device)
        lse = _common.empty((batch, seq, heads), dtype=torch.float32, device=q.device)
        for t0 in range(0, seq, chunk):
            t1 = min(seq, t0 + chunk)
            q576, idx, _ = _chunk_inputs(q, indices, t0, t1)
            o, l = backend.fwd(q576, kv576, idx, scale)
            out[:, t0:t1] = o[:, : t1 - t0]
            lse[:, t0:t1] = l[:, : t1 - t0]
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.backend, ctx.chunk = scale, backend, chunk
        if not return_lse:
            return out
        natural = natural_lse(lse, indices)
        ctx.mark_non_differentiable(natural)
        return out, natural

    @staticmethod
    def backward(ctx, dout, _dlse=None):
        q, kv, indices, out, lse = ctx.saved_tensors
        seq, kv_len = q.shape[1], kv.shape[1]
        kv576 = _pad_kv(kv)
        dq = _common.empty(q.shape, dtype=q.dtype, device=q.device)
        single = seq <= ctx.chunk
        dkv = None
        for t0 in range(0, seq, ctx.chunk):
            t1 = min(seq, t0 + ctx.chunk)
            q576, idx, rows = _chunk_inputs(q, indices, t0, t1)
            o = _pad_rows(out, t0, t1, rows, VALUE_DIM, 0.0)
            do = _pad_rows(dout.to(out.dtype), t0, t1, rows, VALUE_DIM, 0.0)
            l = _pad_rows(lse.unsqueeze(-1), t0, t1, rows, 1, 0.0).squeeze(-1)
            dq576, dkv576 = ctx.backend.bwd(q576.contiguous(), kv576, o, do, idx, l.contiguous(), ctx.scale)
            dq[:, t0:t1] = dq576[:, : t1 - t0, :, :VALUE_DIM]
            part = dkv576[:, :kv_len, 0, :VALUE_DIM]
            if single:  # the kernel accumulated in fp32 and rounded once
                dkv = part
            else:  # several chunks: sum their (bf16-rounded) contributions in fp32
                dkv = part.float() if dkv is None else dkv.add_(part)
        return dq, dkv.to(kv.dtype), None, None, None, None, None


def natural_lse(lse2: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The kernels' base-2 lse [B,T,H] -> the contract's natural-log lse, -inf for a row without keys."""
    has_key = (indices >= 0).any(-1, keepdim=True)
    return torch.where(has_key, lse2 * LN2, float("-inf"))


def sparse_attention(q, kv, indices, *, scale: float, backend: Backend, budget_bytes: int = QUERY_BUDGET_BYTES,
                     return_lse: bool = False):
    """The op on any backend (no device checks): the padding/chunking path the tests exercise."""
    chunk = query_chunk(q.shape[2], indices.shape[-1], budget_bytes)
    return _PaddedSparseMLA.apply(q, kv, indices.contiguous(), float(scale), backend, chunk, return_lse)


def dsa_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, return_lse: bool = False):
    """The "dsa_sparse_attention" op (docs/ops.md) on megatron-core's TileLang kernels."""
    _common.require_cuda(q, kv, indices)
    check_supported(q, kv, indices)
    if not math.isfinite(scale):
        raise KernelUnsupported(f"scale must be finite, got {scale}")
    return sparse_attention(q, kv, indices, scale=scale, backend=_backend(), return_lse=return_lse)


_BACKEND: Backend | None = None


def _backend() -> Backend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = megatron_backend()
    return _BACKEND


def compile_kernels(heads: int, topk: int, scale: float, arch: str = "sm_90") -> dict[str, str]:
    """Lower and nvcc-compile the forward and backward kernels for `arch` without a GPU (the CPU
    compile check); returns {name: generated CUDA source}. Needs megatron-core and tilelang."""
    import tilelang
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_bwd as mbwd
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as mfwd
    from tilelang import tvm

    width = _common.round_up(topk, TOPK_MULTIPLE)
    builds = {
        "fwd": (mfwd.sparse_mla_fwd.get_tir(heads, VALUE_DIM, TAIL_DIM, width, 1, scale), mfwd._SPARSE_MLA_FWD_PASS_CONFIGS),
        "bwd": (mbwd.bwd.get_tir(heads, VALUE_DIM, TAIL_DIM, width, 1, scale), mbwd._SPARSE_MLA_BWD_PASS_CONFIGS),
    }
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    sources = {}
    for name, (tir, config) in builds.items():
        with tvm.transform.PassContext(config=config), target:
            sources[name] = tilelang.lower(tir, target=target, enable_device_compile=True).kernel_source
    return sources
