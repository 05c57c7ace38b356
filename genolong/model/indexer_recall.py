"""How much of the dense attention the indexer's selection keeps: its "recall".

For a sample of queries, dense causal attention over every visible key (the attention the layer
would compute without the indexer) is split into the share on the selected keys (selected pools
plus the tail pool) and the rest. Recall 1 means the sparse layer loses nothing; a random
indexer at 512k with 2048 of up to 512k keys keeps roughly what a uniform pick would. A diagnostic
of the indexer (docs/model.md), measured every N steps by genolong/train/indexer.py.
"""

from __future__ import annotations

import torch

# Upper bound on dense-score elements per chunk of sampled queries (fp32: 64 MiB).
_SCORE_ELEMENTS = 1 << 24


def sample_queries(seq: int, width: int, n: int, device=None) -> torch.Tensor:
    """Up to n query positions spread evenly over the sparse part of the sequence (positions >= width,
    where a query sees more keys than it selects); over the whole sequence if there is none."""
    first = width if seq > width else 0
    return torch.linspace(first, seq - 1, min(n, seq - first), device=device).round().long().unique()


@torch.no_grad()
def selection_recall(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, positions: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Per sampled query, the dense attention mass on its selected keys, averaged over heads.

    q [B,T,H,Dl], kv [B,T,Dl] (keys = values = the latent), indices [B,T,W], positions long [n]
    -> fp32 [B, n] in [0, 1].
    """
    batch, _, heads, _ = q.shape
    step = max(1, _SCORE_ELEMENTS // max(1, batch * heads * kv.shape[1]))
    out = []
    for i in range(0, positions.numel(), step):
        pos = positions[i : i + step]
        last = int(pos.max()) + 1
        scores = torch.einsum("bnhd,bjd->bnhj", q[:, pos].float(), kv[:, :last].float()) * scale
        visible = torch.arange(last, device=q.device) <= pos[:, None]
        probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
        idx = indices[:, pos].long()  # [B, n, W]
        picked = probs.gather(-1, idx.clamp(min=0).unsqueeze(2).expand(-1, -1, heads, -1))
        out.append((picked * (idx >= 0).unsqueeze(2)).sum(-1).mean(-1))
    return torch.cat(out, dim=1)


class RecallProbe:
    """Set as `DSAAttention.recall_probe` for one step: each layer with an indexer records the mean
    recall of `n_queries` sampled queries of its first forward (a recomputed forward is skipped)."""

    def __init__(self, n_queries: int = 256) -> None:
        self.n_queries = n_queries
        self.values: dict[int, float] = {}

    def measure(self, layer_idx: int, q, kv, indices, *, scale: float, width: int) -> None:
        if layer_idx in self.values:
            return
        positions = sample_queries(q.shape[1], width, self.n_queries, device=q.device)
        self.values[layer_idx] = float(selection_recall(q, kv, indices, positions, scale=scale).mean())
