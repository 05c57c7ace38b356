"""Manifold-constrained hyper-connections (mHC): n residual streams per token instead of one.

Around each sublayer (mixer, then MLP), 2n + n^2 mixing logits per token come from the
flattened, RMS-normalised streams through one projection `fn`:
- pre (n):  sigmoid weights that collapse the streams into the sublayer's input;
- post (n): 2 * sigmoid weights that spread the sublayer's output back over the streams;
- comb (n x n): softmax rows made doubly stochastic by Sinkhorn iterations, mixing the old
  streams into the new ones: new[o] = post[o] * f(x) + sum_i comb[i, o] * old[i].
The model's final output is the plain mean of the streams (`hc_head`).

No fp32 copy of the [B, T, n * hidden] input is made (the original recipe's no-needless-fp32): the RMS statistic
is reduced in fp32 and applied to the n^2 + 2n projected logits instead (the norm is a per-row
scalar, so linear(x * r) = r * linear(x)); the projection and the collapse run in the streams'
dtype. In fp32 this is the reference's arithmetic up to rounding.

The math is in module-level functions of tensors (`mix_weights`, `sinkhorn`, `collapse`,
`expand`) so that genolong.train.compile can compile them once for every layer; the modules
only hold the parameters. These eager functions are the references of the fused versions and of
the faster eager ones (genolong/model/mhc_eager.py). `HyperConnection` runs its two halves as the
ops "mhc_mix_collapse" and "mhc_expand" (genolong.model.ops): their references are the faster
eager functions, the fused Triton passes are genolong/kernels/mhc/fused.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from genolong.model import ops
from genolong.model.config import MHCConfig


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, cfg: MHCConfig, rms_eps: float, layer_idx: int = -1) -> None:
        super().__init__()
        n = cfg.num_streams
        self.layer_idx = layer_idx  # for the kernel audit (genolong.model.ops)
        self.n = n
        self.sinkhorn_iters = cfg.sinkhorn_iters
        self.eps = cfg.eps
        self.rms_eps = rms_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B,T,n,D] -> (post fp32 [B,T,n], comb fp32 [B,T,n,n], collapsed [B,T,D])."""
        return ops.call("mhc_mix_collapse", self.layer_idx, streams, self.fn, self.base, self.scale, n=self.n,
                        iters=self.sinkhorn_iters, eps=self.eps, rms_eps=self.rms_eps)

    def expand(self, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The new streams after the sublayer (see `expand`); a method so that it can be swapped per instance."""
        return ops.call("mhc_expand", self.layer_idx, post, comb, out, residual)


def mix_collapse_reference(streams, fn, base, scale, *, n: int, iters: int, eps: float, rms_eps: float):
    """The op "mhc_mix_collapse": (post fp32 [.., n], comb fp32 [.., n, n], collapsed [.., D]) from streams [.., n, D]."""
    from genolong.model import mhc_eager  # the faster eager versions of this module's references

    pre, post, comb = mix_weights(streams, fn, base, scale, n=n, eps=eps, rms_eps=rms_eps)
    comb = mhc_eager.sinkhorn(comb, iters, eps)
    return post, comb, mhc_eager.collapse(pre, streams)


def expand_reference(post, comb, out, residual):
    """The op "mhc_expand": the new streams (see `expand`)."""
    from genolong.model import mhc_eager

    return mhc_eager.expand(post, comb, out, residual)


ops.register("mhc_mix_collapse", ops.REFERENCE, mix_collapse_reference)
ops.register("mhc_expand", ops.REFERENCE, expand_reference)


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


class HyperHead(nn.Module):
    """GLM-5.3-Flash's final collapse: the unweighted mean of the streams (no parameters)."""

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=-2)
