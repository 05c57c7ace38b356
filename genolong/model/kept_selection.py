"""The indexer's selection kept compactly for a recompute (genolong.train.keep).

A "dsa_indexer_topk" row is `topk_pools` pools of `kpool` consecutive tokens, then (with the tail)
the query's own incomplete pool: int32 [T, topk_pools * kpool + kpool - 1], 8 KiB a token for
GLM-5.3's 512 pools of 4, 4 GiB per DSA layer at 512k. Kept until backward in pinned host memory
for 11 layers that is 44 GiB; as one pool index per group plus the tail slots it is 2 KiB a token,
and expanding it again is one pass. A row whose groups are not whole pools in ascending token
order (an implementation free to order a row otherwise, docs/ops.md) is kept as it is. With the
kernels loaded on CUDA the check and the expansion run as one Triton pass each (FUSED below;
GENOLONG_KEPT_SELECTION=torch keeps the PyTorch passes).
"""

from __future__ import annotations

import torch

from genolong.model import frames

# Rows compared per pass when checking that a selection packs (bounds the check's temporaries).
_CHECK_ROWS = 1 << 16
# One-pass versions of the check and the expansion, applied from outside by genolong.kernels.load()
# (genolong/kernels/indexer/kept_selection.py): "enabled"(t, kpool), "pack"(idx, kpool=, topk_pools=)
# -> (pools, tail, differs), "expand"(pools, tail, kpool=). Empty: the PyTorch passes below.
FUSED: dict = {}


def _packed_parts(idx: torch.Tensor, *, kpool: int, topk_pools: int) -> tuple[torch.Tensor, ...] | None:
    """(pools, tail, differs: 0-d bool on idx's device) — the packed form and whether it would not give
    `idx` back — or None when `idx` has no whole groups to pack. No host sync."""
    groups = topk_pools * kpool
    if kpool < 2 or idx.shape[-1] < groups:
        return None
    if FUSED and FUSED["enabled"](idx, kpool):
        return FUSED["pack"](idx, kpool=kpool, topk_pools=topk_pools)
    body = idx[..., :groups]
    pools = torch.div(body[..., ::kpool], kpool, rounding_mode="floor")  # -1 // kpool = -1
    flat_pools, flat_body = pools.reshape(-1, topk_pools), body.reshape(-1, groups)
    # One flag on the device for all row blocks: its answer is read once.
    differs = torch.zeros((), dtype=torch.bool, device=idx.device)
    for r0 in range(0, flat_body.shape[0], _CHECK_ROWS):
        rows = slice(r0, r0 + _CHECK_ROWS)
        differs |= (_expand(flat_pools[rows], kpool) != flat_body[rows]).any()
    return pools.contiguous(), idx[..., groups:].contiguous(), differs


def pack_selection(idx: torch.Tensor, *, kpool: int, topk_pools: int) -> tuple[torch.Tensor, ...]:
    """(pools [.., topk_pools], tail [.., W - topk_pools * kpool]) when every group of `idx` is one whole
    pool in ascending order (or all -1), else (idx,). Reads the answer at once (a host sync);
    `pack_selection_deferred` does not."""
    parts = _packed_parts(idx, kpool=kpool, topk_pools=topk_pools)
    if parts is None or bool(parts[2]):
        return (idx,)
    return parts[0], parts[1]


class PendingPack(frames.DeferredKept):
    """A selection whose packed form is kept once the device has said it packs (`resolve`).

    Reading the check's flag at once was a host sync per DSA layer, and its tiny copy queued behind
    the kept tensors' copies to host memory already in flight: the compute stream stood idle ~8 ms
    each time (eleven times a 128k step: H200, 2026-12-03). Here the flag
    is copied to pinned memory on a stream of its own; the keep layer (genolong.train.keep) resolves
    the choice when the layer's next kept op records (the sparse attention, ~100 ms of GPU work
    later) or when the layer's forward ends, so `idx` is held no longer than the layer holds it
    anyway. The forward itself goes on with `idx` (`value`)."""

    def __init__(self, idx: torch.Tensor, pools: torch.Tensor, tail: torch.Tensor, differs: torch.Tensor) -> None:
        self.value = idx
        self._parts: tuple | None = (idx, pools, tail)
        if differs.is_cuda:
            self._flag = torch.empty(differs.shape, dtype=torch.bool, pin_memory=True)
            side = _flag_stream(differs.device)
            side.wait_stream(torch.cuda.current_stream(differs.device))
            with torch.cuda.stream(side):
                self._flag.copy_(differs, non_blocking=True)
                self._done = torch.cuda.Event()
                self._done.record(side)
            differs.record_stream(side)  # the flag's memory is not reused before the copy has read it
        else:
            self._flag, self._done = differs, None

    def resolve(self) -> tuple[torch.Tensor, ...]:
        if self._parts is None:
            raise RuntimeError("a PendingPack resolves once")
        if self._done is not None:
            self._done.synchronize()  # long complete by now (a layer of compute); waits only if not
        idx, pools, tail = self._parts
        self._parts = None
        self.value = None
        return (idx,) if bool(self._flag) else (pools, tail)


_FLAG_STREAMS: dict = {}


def _flag_stream(device: torch.device) -> torch.cuda.Stream:
    key = torch.device(device).index
    if key not in _FLAG_STREAMS:
        _FLAG_STREAMS[key] = torch.cuda.Stream(device=device)
    return _FLAG_STREAMS[key]


def pack_selection_deferred(idx: torch.Tensor, *, kpool: int, topk_pools: int):
    """`pack_selection` without the host sync: a PendingPack (its `resolve()` is the kept tuple), or
    (idx,) when `idx` has no whole groups to pack."""
    parts = _packed_parts(idx, kpool=kpool, topk_pools=topk_pools)
    return (idx,) if parts is None else PendingPack(idx, *parts)


def unpack_selection(kept, *, kpool: int) -> torch.Tensor:
    """The selection `pack_selection` kept (or, in the forward, the one a PendingPack holds)."""
    if isinstance(kept, PendingPack):
        return kept.value
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
frames.register_keepable(
    "dsa_indexer_topk",
    frames.KeepSpec(kept=lambda out, kwargs: pack_selection_deferred(out, kpool=kwargs["kpool"], topk_pools=kwargs["topk_pools"])),
)
frames.register_replay("dsa_indexer_topk", frames.ANY, lambda kept, *args, **kwargs: unpack_selection(kept, kpool=kwargs["kpool"]))
