"""The fused "dsa_indexer_loss" op: the DSA indexer's sparse-stage KL and its gradient (docs/ops.md).

The oracle is `genolong.model.indexer_loss.indexer_loss_reference`. Per batch row and chunk of
queries (sized so the fp32 [chunk, selected pools] buffers stay within `BUDGET_BYTES`, whatever
the length):
1. Triton: attention mass per selected pool, rebuilt from the sparse attention's lse
   (indexer_loss_triton.pool_mass);
2. Triton: the indexer scores of the selected pools (index_logits);
3. PyTorch on [chunk, S]: target = mass normalised over the valid pools, log-softmax of the
   scores, KL per query, dKL/dscores = softmax * sum(target) - target, times grad_scale;
4. Triton: the gradient to index_q, head_weights (per query) and pool_keys (fp32 atomics)
   (index_backward).
Registering this module needs no Triton: it is imported when the op first runs.
"""

from __future__ import annotations

import torch

from genolong.kernels import _common
from genolong.model.indexer_loss import normalise
from genolong.model.ops import KernelUnsupported

# fp32 [chunk, S] buffers alive at once in step 3 (mass, scores, target, log-softmax, dscores, temp).
_BUFFERS = 6
BUDGET_BYTES = 512 << 20
KEYS_PER_BLOCK = 64  # = indexer_loss_triton.KEYS_PER_BLOCK: kpool must divide it


def check_supported(index_q, pool_keys, head_weights, q, kv, indices, lse, *, kpool: int, topk_pools: int) -> None:
    if index_q.ndim != 4 or q.ndim != 4 or kv.ndim != 3 or indices.ndim != 3 or pool_keys.ndim != 3:
        raise KernelUnsupported(
            f"expects index_q/q [B,T,H,D], kv/pool_keys [B,S,D], indices [B,T,W]; got {tuple(index_q.shape)}, "
            f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}"
        )
    if kpool > KEYS_PER_BLOCK or KEYS_PER_BLOCK % kpool:
        raise KernelUnsupported(f"kpool must divide {KEYS_PER_BLOCK}, got {kpool}")
    if indices.shape[-1] < topk_pools * kpool:
        raise KernelUnsupported(f"indices have {indices.shape[-1]} slots, fewer than topk_pools * kpool = {topk_pools * kpool}")
    if q.shape[2] > 128 or index_q.shape[2] > 64:
        raise KernelUnsupported(f"at most 128 attention heads and 64 indexer heads, got {q.shape[2]} and {index_q.shape[2]}")
    if q.shape[-1] > 1024 or index_q.shape[-1] > 256:
        raise KernelUnsupported(f"latent width at most 1024 and indexer head dim at most 256, got {q.shape[-1]} and {index_q.shape[-1]}")
    _common.require_dtype("indices", indices, torch.int32)
    _common.require_dtype("lse", lse, torch.float32)
    _common.require_dtype("head_weights", head_weights, torch.float32)
    for name, t in (("q", q), ("kv", kv), ("index_q", index_q), ("pool_keys", pool_keys)):
        _common.require_dtype(name, t, torch.bfloat16, torch.float16, torch.float32)
    if q.dtype != kv.dtype or index_q.dtype != pool_keys.dtype:
        raise KernelUnsupported(f"q/kv and index_q/pool_keys must share a dtype, got {q.dtype}/{kv.dtype}, {index_q.dtype}/{pool_keys.dtype}")


def chunk_rows(topk_pools: int, budget_bytes: int = BUDGET_BYTES) -> int:
    """Queries per chunk: the fp32 [chunk, S] buffers of step 3 fit the budget (at least 16 queries)."""
    return max(16, budget_bytes // (_BUFFERS * 4 * max(1, topk_pools)))


def indexer_loss(index_q, pool_keys, head_weights, q, kv, indices, lse, *, kpool: int, topk_pools: int,
                 index_scale: float, scale: float, grad_scale: float, budget_bytes: int = BUDGET_BYTES):
    """The op on any device Triton runs on (its interpreter on the CPU); no device checks."""
    check_supported(index_q, pool_keys, head_weights, q, kv, indices, lse, kpool=kpool, topk_pools=topk_pools)
    from genolong.kernels.indexer import loss_triton as tk

    batch, seq = q.shape[:2]
    sel, device = topk_pools, q.device
    kl = _common.empty((batch, seq), dtype=torch.float32, device=device)
    d_iq = _common.empty(index_q.shape, dtype=index_q.dtype, device=device)
    d_w = _common.empty(head_weights.shape, dtype=torch.float32, device=device)
    d_pk = torch.zeros(batch, pool_keys.shape[1], tk.padded_dim(index_q.shape[-1]), dtype=torch.float32, device=device)
    if sel == 0:
        return kl.zero_(), d_iq.zero_(), d_pk[..., : index_q.shape[-1]].to(pool_keys.dtype), d_w.zero_()
    rows = chunk_rows(sel, budget_bytes)
    for b in range(batch):
        qb, kvb, idxb, lseb = q[b].contiguous(), kv[b].contiguous(), indices[b].contiguous(), lse[b].contiguous()
        iqb, pkb, wb = index_q[b].contiguous(), pool_keys[b].contiguous(), head_weights[b].contiguous()
        for t0 in range(0, seq, rows):
            t1 = min(seq, t0 + rows)
            idx = idxb[t0:t1]
            mass = _common.empty((t1 - t0, sel), dtype=torch.float32, device=device)
            tk.pool_mass(qb[t0:t1], kvb, idx, lseb[t0:t1], mass, kpool=kpool, scale=scale)
            scores = _common.empty((t1 - t0, sel), dtype=torch.float32, device=device)
            tk.index_logits(iqb[t0:t1], pkb, wb[t0:t1], idx, scores, kpool=kpool, index_scale=index_scale)

            valid = idx[:, : sel * kpool : kpool] >= 0
            target = normalise(mass.masked_fill_(~valid, 0.0))
            del mass
            logp = scores.masked_fill_(~valid, torch.finfo(torch.float32).min).log_softmax(-1)
            del scores
            kl[b, t0:t1] = (torch.xlogy(target, target) - target * logp).sum(-1)
            dscores = logp.exp_().mul_(target.sum(-1, keepdim=True)).sub_(target).mul_(grad_scale)
            del target, logp
            tk.index_backward(iqb[t0:t1], pkb, wb[t0:t1], idx, dscores, d_iq[b, t0:t1], d_pk[b], d_w[b, t0:t1],
                              kpool=kpool, index_scale=index_scale)
    return kl, d_iq, d_pk[..., : index_q.shape[-1]].to(pool_keys.dtype), d_w


def dsa_indexer_loss_fused(index_q, pool_keys, head_weights, q, kv, indices, lse, *, kpool: int, topk_pools: int,
                           index_scale: float, scale: float, grad_scale: float):
    """The "dsa_indexer_loss" op (docs/ops.md) on the GPU, through Triton."""
    _common.require_cuda(index_q, pool_keys, head_weights, q, kv, indices, lse)
    try:
        import genolong.kernels.indexer.loss_triton  # noqa: F401
    except ImportError as why:
        raise KernelUnsupported(f"triton is not importable: {why}") from why
    return indexer_loss(index_q, pool_keys, head_weights, q, kv, indices, lse, kpool=kpool, topk_pools=topk_pools,
                        index_scale=index_scale, scale=scale, grad_scale=grad_scale)
