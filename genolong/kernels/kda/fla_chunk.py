"""KDA through flash-linear-attention's chunked kernel (`fla.ops.kda.chunk_kda`).

The op's conventions (docs/ops.md) are fla's with `use_qk_l2norm_in_kernel=True`: q and k arrive
un-normalised and fla L2-normalises them as x / sqrt(sum(x^2) + 1e-6), the model reference's
form; g is the per-channel log decay *after* the model's bounded transform (so
`use_gate_in_kernel=False`), beta is already a sigmoid, scale is D^-0.5. fla's `safe_gate` fast
path needs gates known to lie in [-5, 0); the op does not promise that bound, so it stays off.

The recurrent state in and out is fla's own (fla 0.6.0: `initial_state` [B, H, K, V] in fp32,
with a gradient; the final state fp32 [B, H, K, V], differentiable), in the default K-first
layout that the op contract and the reference use.

Inside a layer checkpoint (`frames.checkpointed()`, the training default: full recompute) the call
asks fla to keep its intermediates for backward (`disable_recompute=True`: the chunk states h, w,
u, the gated q and k, v_new) instead of recomputing h and w/u in its backward. The checkpoint's
forward drops them at once and its recompute holds them only until the layer's backward right
after, so this costs one layer's intermediates for a moment (five [T, H, D] tensors: +0.41 GiB of
peak measured at 128k for glm53-mini's 4 heads, H200) and saves fla's second pass over the sequence
(chunk_gated_delta_rule_fwd_h) per layer.
Outside a checkpoint fla's default stays (saved tensors would live for the whole step there).
"""

from __future__ import annotations

import torch

from genolong.kernels import _common
from genolong.model import frames
from genolong.model.kda import check_state
from genolong.model.ops import KernelUnsupported

def keep_intermediates() -> bool:
    """fla keeps its intermediates for backward: inside a layer checkpoint, with gradients on."""
    return torch.is_grad_enabled() and frames.checkpointed()


def kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """The "kda" op on fla's chunk kernel: q, k, v, g [B,T,H,D], beta [B,T,H] -> [B,T,H,Dv], or
    (o, final_state fp32 [B,H,Dk,Dv]) when `output_final_state`."""
    _common.require_cuda(q, k, v, g, beta, *(() if initial_state is None else (initial_state,)))
    if q.shape[-1] > 256:
        raise KernelUnsupported(f"fla's KDA supports key head dims up to 256, got {q.shape[-1]}")
    batch, _, heads, dk = k.shape
    check_state(initial_state, (batch, heads, dk, v.shape[-1]))
    try:
        from fla.ops.kda import chunk_kda
    except Exception as why:
        raise KernelUnsupported(f"flash-linear-attention is not importable: {why}") from why
    o, final_state = chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=dk**-0.5,
        # fla asserts an fp32 state; the cast keeps the caller's gradient path.
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
        disable_recompute=keep_intermediates(),
    )
    o = o.to(q.dtype)
    return (o, final_state) if output_final_state else o
