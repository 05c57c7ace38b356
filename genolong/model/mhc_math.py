"""mHC's per-token math as plain functions of tensors: the references (genolong/model/mhc.py).

The fused Triton passes (genolong/kernels/mhc) and the faster eager versions
(genolong/model/mhc_eager.py) are tested against these; genolong.train.compile compiles them.
The arithmetic (no fp32 copy of the streams, the RMS statistic applied to the logits) is
explained in genolong/model/mhc.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mix_weights(streams, fn, base, scale, *, n: int, eps: float, rms_eps: float):
    """(pre fp32 [.., n], post fp32 [.., n], comb fp32 [.., n, n] before Sinkhorn) from streams [.., n, D]."""
    flat = streams.flatten(-2)
    mean_sq = torch.linalg.vector_norm(flat, dim=-1, keepdim=True, dtype=torch.float32).square() / flat.shape[-1]
    logits = F.linear(flat, fn.to(flat.dtype)).float() * torch.rsqrt(mean_sq + rms_eps)
    return mix_from_logits(logits, base, scale, n=n, eps=eps)


def mix_from_logits(logits, base, scale, *, n: int, eps: float):
    """(pre, post, comb before Sinkhorn) from the RMS-scaled logits fp32 [.., (2 + n) n]: the pointwise tail."""
    pre_l, post_l, comb_l = logits.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)

    pre = torch.sigmoid(pre_l * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_l * post_s + post_b)
    comb = torch.softmax((comb_l * comb_s + comb_b).unflatten(-1, (n, n)), dim=-1) + eps
    return pre, post, comb


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalisation of positive [.., n, n] matrices, ending on columns.

    The reference's order (one column pass, then iters-1 row+column passes) is kept so that the
    result matches it exactly, not just in the limit.
    """
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The sublayer's input: sum_i pre[i] * streams[i], in the streams' dtype."""
    return torch.matmul(pre.to(streams.dtype).unsqueeze(-2), streams).squeeze(-2)


def expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """New streams: post[o] * out + sum_i comb[i, o] * residual[i], in the streams' dtype."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
