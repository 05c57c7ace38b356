"""KDA through flash-linear-attention's chunked kernel (`fla.ops.kda.chunk_kda`).

The op's conventions (docs/ops.md) are fla's with `use_qk_l2norm_in_kernel=True`: q and k arrive
un-normalised and fla L2-normalises them as x / sqrt(sum(x^2) + 1e-6), the model reference's
form; g is the per-channel log decay *after* the model's bounded transform (so
`use_gate_in_kernel=False`), beta is already a sigmoid, scale is D^-0.5. fla's `safe_gate` fast
path needs gates known to lie in [-5, 0); the op does not promise that bound, so it stays off.
"""

from __future__ import annotations

import torch

from genolong.kernels import _common
from genolong.model.ops import KernelUnsupported


def kda_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The "kda" op on fla's chunk kernel: q, k, v, g [B,T,H,D], beta [B,T,H] -> [B,T,H,Dv]."""
    _common.require_cuda(q, k, v, g, beta)
    if q.shape[-1] > 256:
        raise KernelUnsupported(f"fla's KDA supports key head dims up to 256, got {q.shape[-1]}")
    try:
        from fla.ops.kda import chunk_kda
    except Exception as why:
        raise KernelUnsupported(f"flash-linear-attention is not importable: {why}") from why
    o, _ = chunk_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True)
    return o.to(q.dtype)
