"""How much of the dense attention the indexer's selection keeps: its "recall".

For a sample of queries, dense causal attention over every visible key (the attention the layer
would compute without the indexer) is split into the share on the selected keys (selected pools
plus the tail pool) and the rest. Recall 1 means the sparse layer loses nothing; a random
indexer at 512k with 2048 of up to 512k keys keeps roughly what a uniform pick would. A diagnostic
of the indexer (docs/model.md), measured every N steps by genolong/train/indexer.py.
"""

from __future__ import annotations

import torch

# Upper bound on dense-score elements per key block (fp32: 64 MiB): 16k keys for 256 queries x 4 heads.
_SCORE_ELEMENTS = 1 << 24


def sample_queries(seq: int, width: int, n: int, device=None) -> torch.Tensor:
    """Up to n query positions spread evenly over the sparse part of the sequence (positions >= width,
    where a query sees more keys than it selects); over the whole sequence if there is none."""
    first = width if seq > width else 0
    return torch.linspace(first, seq - 1, min(n, seq - first), device=device).round().long().unique()


@torch.no_grad()
def selection_recall(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, positions: torch.Tensor, *, scale: float,
                     key_block: int | None = None, query_offset: int = 0) -> torch.Tensor:
    """Per sampled query, the dense attention mass on its selected keys, averaged over heads.

    q [B,T,H,Dl], kv [B,T,Dl] (keys = values = the latent), indices [B,T,W], positions long [n]
    (q and indices hold the queries at positions query_offset + [0, T): a piece of the sequence kv
    covers, under context parallelism)
    -> fp32 [B, n] in [0, 1]. One pass over blocks of keys with a running max (online softmax):
    the largest tensors are one block's [B, n, H, block] scores and its keys in fp32.
    """
    batch, _, heads, _ = q.shape
    n = positions.numel()
    dtype = torch.promote_types(q.dtype, torch.float32)
    queries = q[:, positions - query_offset].to(dtype)  # [B, n, H, Dl]
    idx = indices[:, positions - query_offset].long()  # [B, n, W]
    block = key_block or max(1, _SCORE_ELEMENTS // max(1, batch * n * heads))
    top = torch.full((batch, n, heads), float("-inf"), dtype=dtype, device=q.device)
    total = torch.zeros_like(top)
    picked = torch.zeros_like(top)
    for k0 in range(0, int(positions.max()) + 1, block):
        k1 = min(int(positions.max()) + 1, k0 + block)
        scores = torch.einsum("bnhd,bjd->bnhj", queries, kv[:, k0:k1].to(dtype)) * scale
        visible = torch.arange(k0, k1, device=q.device) <= positions[:, None]  # [n, block]
        scores = scores.masked_fill(~visible[None, :, None], float("-inf"))
        in_block = (idx >= k0) & (idx < k1)
        selected = torch.zeros(batch, n, k1 - k0, dtype=torch.int32, device=q.device)
        selected.scatter_add_(2, (idx - k0).clamp(0, k1 - k0 - 1), in_block.to(torch.int32))
        # Key 0 is in the first block and visible to every query, so `top` is finite from then on.
        new_top = torch.maximum(top, scores.amax(-1))
        rescale = (top - new_top).exp()
        probs = (scores - new_top.unsqueeze(-1)).exp()
        total = total * rescale + probs.sum(-1)
        picked = picked * rescale + (probs * (selected > 0).unsqueeze(2)).sum(-1)
        top = new_top
    return (picked / total).mean(-1).float()


class RecallProbe:
    """Set as `DSAAttention.recall_probe` for one step: each layer with an indexer records the mean
    recall of `n_queries` sampled queries of its first forward (a recomputed forward is skipped)."""

    def __init__(self, n_queries: int = 256) -> None:
        self.n_queries = n_queries
        self.values: dict[int, float] = {}
        # Pieces (context shards, sequence tiles) measured per layer: (recall sum, count), offsets seen.
        self._sums: dict[int, list[float]] = {}
        self._seen: set[tuple[int, int]] = set()

    def measure(self, layer_idx: int, q, kv, indices, *, scale: float, width: int, piece=None) -> None:
        if piece is None and layer_idx in self.values or piece is not None and (layer_idx, piece.offset) in self._seen:
            return
        if piece is None:
            positions = sample_queries(q.shape[1], width, self.n_queries, device=q.device)
            self.values[layer_idx] = float(selection_recall(q, kv, indices, positions, scale=scale).mean())
            return
        # A piece of the sequence (context parallelism): the whole sequence's sample, each piece
        # measuring the sampled queries it holds; the mean is taken over all pieces.
        positions = sample_queries(piece.length, width, self.n_queries, device=q.device)
        positions = positions[(positions >= piece.offset) & (positions < piece.offset + q.shape[1])]
        total = torch.zeros(2, dtype=torch.float64, device=q.device)
        if positions.numel():
            recall = selection_recall(q, kv, indices, positions, scale=scale, query_offset=piece.offset)
            total[0], total[1] = recall.double().sum(), recall.numel()
        total = piece.total(total)
        # A sequence tile (genolong/train/tiling.py) is one of several pieces this process measures:
        # the layer's value is the mean over every piece seen so far (a recompute's repeat is skipped).
        self._seen.add((layer_idx, piece.offset))
        sums = self._sums.setdefault(layer_idx, [0.0, 0.0])
        sums[0] += float(total[0])
        sums[1] += float(total[1])
        if sums[1]:
            self.values[layer_idx] = sums[0] / sums[1]
