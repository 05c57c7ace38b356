"""KDA's short convolution through flash-linear-attention's causal depthwise conv (Triton).

`fla.modules.causal_conv1d.causal_conv1d(x [B,T,C], weight [C,W], activation="silu")` is the op's
contract (docs/ops.md) in one forward and one backward kernel: the conv and the SiLU are
computed in fp32 and the output rounded once to x's dtype, as the reference does (checked in
Triton's interpreter against fla-core 0.6.0: forward, dx and dw equal the reference to fp32
rounding, with 16-bit x and fp32 weights). It replaces PyTorch's generic depthwise-conv kernels,
the transposes and casts around them and the separate SiLU (1.9% of a 128k glm53-mini step).
"""

from __future__ import annotations

import torch

from genolong.kernels import _common
from genolong.model.ops import KernelUnsupported


def short_conv_fla(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The "kda_short_conv" op on fla's causal_conv1d: x [B,T,C], weight [C,W] -> [B,T,C] in x's dtype."""
    _common.require_cuda(x, weight)
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise KernelUnsupported(f"expects x [B,T,C] and weight [C,W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as why:
        raise KernelUnsupported(f"flash-linear-attention's causal_conv1d is not importable: {why}") from why
    y, _ = causal_conv1d(x, weight, activation="silu")
    return y
