"""KDA's state passing on flash-linear-attention's own context-parallel kernels (fla.ops.cp).

The fused implementations of the ops "kda_cp" and "kda_short_conv_cp" (references: genolong/
parallel/context_kda.py). fla 0.6.0's CP (its README: each rank computes its zero-start state and
its transition matrix in a pre-processing kernel, all-gathers them and merges; the backward does
the same in reverse; the conv's halo comes from the previous rank) needs one flattened sequence
per call: a context over cu_seqlens [0, T] of the whole sequence, split contiguously over the
group, which is exactly genolong's sharding. So B must be 1 (the 1M path's batch); B > 1 is
declined with the reason, and under the "auto" policy the reference state passing runs instead
(on the GPU that is fla's chunk kernel with an initial state, so still fused).

Conventions are those of genolong.kernels.kda.fla_chunk / kda_conv_fla: q and k L2-normalised in the
kernel, g the per-channel log decay after the model's bounded transform, scale D^-0.5, the conv
with SiLU in fp32 and the output in x's dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from genolong.kernels import _common
from genolong.model.ops import KernelUnsupported

_CONTEXTS: dict[tuple, object] = {}


def _cp_context(total: int, group, conv_kernel: int | None, device: torch.device):
    """fla's FLACPContext for one sequence of `total` tokens split over `group` (cached: it is built
    on the host from the lengths only)."""
    key = (total, id(group), conv_kernel, str(device))
    if key not in _CONTEXTS:
        try:
            from fla.ops.cp import build_cp_context
        except Exception as why:
            raise KernelUnsupported(f"flash-linear-attention's context parallelism is not importable: {why}") from why
        cu_seqlens_cpu = torch.tensor([0, total], dtype=torch.long)
        _CONTEXTS[key] = build_cp_context(
            cu_seqlens_cpu.to(device), group=group, conv1d_kernel_size=conv_kernel, cu_seqlens_cpu=cu_seqlens_cpu
        )
    return _CONTEXTS[key]


def _require_one_sequence(t: torch.Tensor) -> None:
    if t.shape[0] != 1:
        raise KernelUnsupported(
            f"fla's context-parallel kernels take one sequence per call (B = 1), got B = {t.shape[0]}; "
            "the state-passing reference handles any batch"
        )


def kda_cp_fla(q, k, v, g, beta, *, group, layer: int = -1) -> torch.Tensor:
    """The "kda_cp" op on fla's chunk_kda with a cp_context: q, k, v, g [1,T/cp,H,D], beta [1,T/cp,H]."""
    _common.require_cuda(q, k, v, g, beta)
    _require_one_sequence(q)
    if q.shape[-1] > 256:
        raise KernelUnsupported(f"fla's KDA supports key head dims up to 256, got {q.shape[-1]}")
    try:
        from fla.ops.kda import chunk_kda
    except Exception as why:
        raise KernelUnsupported(f"flash-linear-attention is not importable: {why}") from why
    context = _cp_context(q.shape[1] * dist.get_world_size(group), group, None, q.device)
    o, _ = chunk_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, cp_context=context)
    return o.to(q.dtype)


def short_conv_cp_fla(x: torch.Tensor, weight: torch.Tensor, *, group, layer: int = -1) -> torch.Tensor:
    """The "kda_short_conv_cp" op on fla's causal_conv1d with a cp_context: x [1, T/cp, C], weight [C, W]."""
    _common.require_cuda(x, weight)
    _require_one_sequence(x)
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise KernelUnsupported(f"expects x [1,T,C] and weight [C,W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not 2 <= weight.shape[-1] <= 4:
        raise KernelUnsupported(f"fla's context-parallel conv takes kernel widths 2-4, got {weight.shape[-1]}")
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as why:
        raise KernelUnsupported(f"flash-linear-attention's causal_conv1d is not importable: {why}") from why
    context = _cp_context(x.shape[1] * dist.get_world_size(group), group, weight.shape[-1], x.device)
    y, _ = causal_conv1d(x, weight, activation="silu", cp_context=context)
    return y
