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

The math is in functions of tensors (genolong/model/mhc_math.py: `mix_weights`, `sinkhorn`,
`collapse`, `expand`) so that genolong.train.compile can compile them once for every layer; the
modules only hold the parameters. Those functions are the references of the fused versions and
of the faster eager ones (genolong/model/mhc_eager.py). `HyperConnection` runs its two halves as
the ops "mhc_mix_collapse" and "mhc_expand" (genolong.model.ops): their references here are built
from the faster eager functions, the fused Triton passes are genolong/kernels/mhc/fused.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from genolong.model import mhc_eager, ops
from genolong.model.config import MHCConfig
from genolong.model.mhc_math import mix_weights


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
        """The new streams after the sublayer (see `mhc_math.expand`); a method so that it can be swapped per instance."""
        return ops.call("mhc_expand", self.layer_idx, post, comb, out, residual)


def mix_collapse_reference(streams, fn, base, scale, *, n: int, iters: int, eps: float, rms_eps: float):
    """The op "mhc_mix_collapse": (post fp32 [.., n], comb fp32 [.., n, n], collapsed [.., D]) from streams [.., n, D]."""
    pre, post, comb = mix_weights(streams, fn, base, scale, n=n, eps=eps, rms_eps=rms_eps)
    comb = mhc_eager.sinkhorn(comb, iters, eps)
    return post, comb, mhc_eager.collapse(pre, streams)


def expand_reference(post, comb, out, residual):
    """The op "mhc_expand": the new streams (genolong.model.mhc_math.expand)."""
    return mhc_eager.expand(post, comb, out, residual)


ops.register("mhc_mix_collapse", ops.REFERENCE, mix_collapse_reference)
ops.register("mhc_expand", ops.REFERENCE, expand_reference)


class HyperHead(nn.Module):
    """GLM-5.3-Flash's final collapse: the unweighted mean of the streams (no parameters)."""

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=-2)
