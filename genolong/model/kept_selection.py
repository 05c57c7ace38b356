"""The indexer's selection kept compactly for a recompute (genolong.train.keep).

A "dsa_indexer_topk" row is `topk_pools` pools of `kpool` consecutive tokens, then (with the tail)
the query's own incomplete pool: int32 [T, topk_pools * kpool + kpool - 1], 8 KiB a token for
GLM-5.3's 512 pools of 4, 4 GiB per DSA layer at 512k. Kept until backward in pinned host memory
for 11 layers that is 44 GiB; as one pool index per group plus the tail slots it is 2 KiB a token,
and expanding it again is one pass. A row whose groups are not whole pools in ascending token
order (an implementation free to order a row otherwise, docs/ops.md) is kept as it is. With the
kernels loaded and GENOLONG_KEPT_SELECTION=triton (opt-in) the check and the expansion run as one
Triton pass each (FUSED below).
"""

from __future__ import annotations

import torch

from genolong.model import ops

# Rows compared per pass when checking that a selection packs (bounds the check's temporaries).
_CHECK_ROWS = 1 << 16
# One-pass versions of the check and the expansion, applied from outside by genolong.kernels.load()
# (genolong/kernels/kept_selection_triton.py): "enabled"(t, kpool), "pack"(idx, kpool=, topk_pools=)
# -> (pools, tail, differs), "expand"(pools, tail, kpool=). Empty: the PyTorch passes below.
FUSED: dict = {}


def pack_selection(idx: torch.Tensor, *, kpool: int, topk_pools: int) -> tuple[torch.Tensor, ...]:
    """(pools [.., topk_pools], tail [.., W - topk_pools * kpool]) when every group of `idx` is one whole
    pool in ascending order (or all -1), else (idx,)."""
    groups = topk_pools * kpool
    if kpool < 2 or idx.shape[-1] < groups:
        return (idx,)
    if FUSED and FUSED["enabled"](idx, kpool):
        pools, tail, differs = FUSED["pack"](idx, kpool=kpool, topk_pools=topk_pools)
        return (idx,) if bool(differs) else (pools, tail)
    body = idx[..., :groups]
    pools = torch.div(body[..., ::kpool], kpool, rounding_mode="floor")  # -1 // kpool = -1
    flat_pools, flat_body = pools.reshape(-1, topk_pools), body.reshape(-1, groups)
    # One flag on the device, read once: a host sync per chunk would stall the GPU's queue each time.
    differs = torch.zeros((), dtype=torch.bool, device=idx.device)
    for r0 in range(0, flat_body.shape[0], _CHECK_ROWS):
        rows = slice(r0, r0 + _CHECK_ROWS)
        differs |= (_expand(flat_pools[rows], kpool) != flat_body[rows]).any()
    if bool(differs):
        return (idx,)
    return pools.contiguous(), idx[..., groups:].contiguous()


def unpack_selection(kept: tuple[torch.Tensor, ...], *, kpool: int) -> torch.Tensor:
    """The selection `pack_selection` kept."""
    if len(kept) == 1:
        return kept[0]
    pools, tail = kept
    if FUSED and FUSED["enabled"](pools, kpool):
        return FUSED["expand"](pools, tail, kpool=kpool)
    return torch.cat([_expand(pools, kpool), tail], dim=-1)


def _expand(pools: torch.Tensor, kpool: int) -> torch.Tensor:
    tokens = pools.unsqueeze(-1) * kpool + torch.arange(kpool, device=pools.device, dtype=pools.dtype)
    return tokens.masked_fill((pools < 0).unsqueeze(-1), -1).flatten(-2)


# The selection is an integer tensor made without gradient: whichever implementation made it, the
# recompute can take the forward's as it is.
ops.register_keepable(
    "dsa_indexer_topk",
    ops.KeepSpec(kept=lambda out, kwargs: pack_selection(out, kpool=kwargs["kpool"], topk_pools=kwargs["topk_pools"])),
)
ops.register_replay("dsa_indexer_topk", ops.ANY, lambda kept, *args, **kwargs: unpack_selection(kept, kpool=kwargs["kpool"]))
