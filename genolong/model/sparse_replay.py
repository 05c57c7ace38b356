"""The sparse attention replayed from its kept output: its backward computed from (out, lse).

Under full recompute a layer's forward runs twice; genolong.train.keep lets the recompute take
the "dsa_sparse_attention" result its forward recorded (out and the natural-log lse) instead of
attending again. What the backward then needs is exactly what a flash-style kernel's backward
reads: q, kv, the indices, out and lse. This module is that backward in plain PyTorch — the
reference for the fused replays (genolong/kernels/sparse_mla/op.py) and what the CPU runs:

    P = exp(scale q.k_j - lse)                   (the forward's probabilities, rebuilt)
    delta = sum_d dO * out                       (= sum_j P_j dP_j)
    dS = P (dO.k_j - delta)
    dq = scale sum_j dS_j k_j
    dkv[idx_j] += scale dS_j q + P_j dO          (kv is the keys and the values)

in query chunks (no [T x T], as the reference forward), accumulated in fp32 at least.
"""

from __future__ import annotations

import torch

from genolong.model import frames, ops

# Gathered-latent elements per query chunk (as the reference forward, genolong.model.dsa).
_GATHER_ELEMENTS = 1 << 24


def sparse_attention_backward_reference(q, kv, indices, out, lse, dout, *, scale: float):
    """(dq, dkv) of the "dsa_sparse_attention" op from its forward's out and lse (module docstring)."""
    batch, seq, heads, latent = q.shape
    width = indices.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    step = max(1, _GATHER_ELEMENTS // max(1, batch * width * latent))
    for t0 in range(0, seq, step):
        idx = indices[:, t0 : t0 + step].long()
        rows = idx.shape[1]
        valid = idx >= 0
        flat = idx.clamp(min=0).reshape(batch, rows * width)
        gathered = kv.gather(1, flat[..., None].expand(-1, -1, latent)).view(batch, rows, width, latent).to(acc)
        qc, oc, doc = (x[:, t0 : t0 + step].to(acc) for x in (q, out, dout))
        scores = torch.matmul(qc, gathered.transpose(-1, -2)) * scale  # [B, t, H, W]
        # A row without keys has lse -inf and gets no gradient (its output was 0).
        probs = torch.exp(scores - lse[:, t0 : t0 + step, :, None].to(acc))
        probs = probs.masked_fill(~valid[:, :, None] | ~torch.isfinite(probs), 0.0)
        delta = (doc * oc).sum(-1, keepdim=True)
        ds = probs * (torch.matmul(doc, gathered.transpose(-1, -2)) - delta)
        dq[:, t0 : t0 + step] = torch.matmul(ds, gathered) * scale
        # Per slot: sum over heads of (scale dS q + P dO) -> [B, t, W, Dl], added to its key's row.
        contrib = torch.matmul(ds.transpose(-1, -2), qc) * scale + torch.matmul(probs.transpose(-1, -2), doc)
        contrib = contrib.masked_fill(~valid[..., None], 0.0)
        dkv.scatter_add_(1, flat[..., None].expand(-1, -1, latent), contrib.reshape(batch, rows * width, latent))
    return dq.to(q.dtype), dkv.to(kv.dtype)


class _KeptSparseAttention(torch.autograd.Function):
    """Returns the kept (out, lse); its backward is `sparse_attention_backward_reference`."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale, kept):
        out, lse = kept
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        # Fresh aliases: autograd gives them this node as their history, the kept tensors stay as they are.
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    @torch.autograd.function.once_differentiable  # out and lse are constants here: no double backward
    def backward(ctx, dout, _dlse):
        q, kv, indices, out, lse = ctx.saved_tensors
        dq, dkv = sparse_attention_backward_reference(q, kv, indices, out, lse, dout, scale=ctx.scale)
        return dq, dkv, None, None, None


def sparse_attention_replay_reference(kept, q, kv, indices, *, scale: float, return_lse: bool = False):
    """The op's result rebuilt from the kept (out, lse) of the same inputs, with the op's gradient."""
    out, lse = _KeptSparseAttention.apply(q, kv, indices, float(scale), tuple(kept))
    return (out, lse) if return_lse else out


# Recorded with the lse (the replay's backward needs it); the replay returns what the caller asked for.
frames.register_keepable("dsa_sparse_attention", frames.KeepSpec(record_kwargs={"return_lse": True}, kept=lambda out, kwargs: tuple(out)))
frames.register_replay("dsa_sparse_attention", ops.REFERENCE, sparse_attention_replay_reference)
