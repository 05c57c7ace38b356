"""The DSA "lightning" indexer: which keys each query of a DSA layer attends to.

Keys are compressed in pools of `kpool` consecutive tokens (a learned, per-channel softmax
average: gate scores from the hidden state plus a position-in-pool bias). Each query scores
every complete pool that has ended by its position, keeps the best `topk // kpool`, and (by
default) also takes its own incomplete tail pool, so it always sees its most recent tokens.

The selection is discrete, so the language-modelling loss never reaches the indexer. By default
it is frozen (run under no_grad, like the reference); trained, it learns only from its own KL
loss against the main attention (genolong/model/indexer_loss.py, docs/model.md), which is why
`project` (the differentiable part: queries, pooled keys, head weights) is separate from
`select` (the top-k). Scoring is the hot op "dsa_indexer_topk"; `indexer_topk_reference` below
is its oracle, chunked over queries so the [queries x pools] score matrix never exists whole
(the original recipe's query-chunked indexer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from genolong.model import ops
from genolong.model.config import IndexerConfig
from genolong.model.piece import SequencePiece

# Upper bound on score-matrix elements per query chunk in the reference (fp32: 256 MiB).
_SCORE_ELEMENTS = 1 << 26
# On the CPU, chunks small enough to stay in cache (4 MiB of scores): fresh 256 MiB temporaries
# cost page faults and memory passes that made the 2k `tiny` indexer several times slower.
_CPU_SCORE_ELEMENTS = 1 << 20


def indexer_topk_reference(
    index_q: torch.Tensor,
    pool_keys: torch.Tensor,
    head_weights: torch.Tensor,
    *,
    kpool: int,
    topk_pools: int,
    always_select_tail: bool,
    softmax_scale: float,
    query_offset: int = 0,
) -> torch.Tensor:
    """The "dsa_indexer_topk" op (docs/ops.md) -> int32 [B, T, W], -1 for unused slots.

    The queries sit at sequence positions query_offset + [0, T) and the pools cover the sequence
    from position 0, so a piece of a sequence (context parallelism) selects exactly what the
    same queries select when the whole sequence is scored at once; indices are global positions.
    """
    batch, seq, heads, _ = index_q.shape
    device = index_q.device
    # Pools past the last query's position can never be selected: leave them out of the products.
    n_pools = min(pool_keys.shape[1], (query_offset + seq) // kpool)
    select = min(topk_pools, n_pools)
    width = topk_pools * kpool + (kpool - 1 if always_select_tail else 0)
    out = torch.full((batch, seq, width), -1, dtype=torch.int32, device=device)

    keys_t = pool_keys[:, :n_pools].float().transpose(-1, -2)  # [B, D, P]
    in_pool = torch.arange(kpool, device=device)
    limit = _SCORE_ELEMENTS if device.type != "cpu" else min(_SCORE_ELEMENTS, _CPU_SCORE_ELEMENTS)
    step = max(1, limit // max(1, batch * heads * n_pools))
    for t0 in range(0, seq, step):
        t1 = min(seq, t0 + step)
        t = torch.arange(query_offset + t0, query_offset + t1, device=device)
        # Pools whose last token is at or before the query: p < (t + 1) // kpool; none of the
        # chunk's queries sees past the last one's pools, so the later ones are not scored.
        n_visible = (t + 1) // kpool
        chunk_pools = min(n_pools, (query_offset + t1) // kpool)
        chunk_select = min(select, chunk_pools)
        if chunk_select > 0:
            # All the chunk's heads against the pools in one product: [B, t * H, D] x [B, D, P].
            q = index_q[:, t0:t1].float()
            scores = torch.matmul(q.flatten(1, 2), keys_t[..., :chunk_pools]).view(batch, t1 - t0, heads, chunk_pools)
            scores = F.relu(scores * softmax_scale)  # [B, t, H, P]
            scores = torch.matmul(head_weights[:, t0:t1].float().unsqueeze(-2), scores).squeeze(-2)  # [B, t, P]
            visible = torch.arange(chunk_pools, device=device) < n_visible[:, None]
            scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
            pools = scores.topk(chunk_select, dim=-1).indices  # [B, t, chunk_select]
            tokens = pools.unsqueeze(-1) * kpool + in_pool
            tokens = tokens.masked_fill((pools >= n_visible[:, None]).unsqueeze(-1), -1)
            out[:, t0:t1, : chunk_select * kpool] = tokens.flatten(-2).to(torch.int32)
        if always_select_tail and kpool > 1:
            n_tail = (t + 1) % kpool
            tail = (t + 1 - n_tail)[:, None] + in_pool[:-1]
            tail = tail.masked_fill(in_pool[:-1] >= n_tail[:, None], -1)
            out[:, t0:t1, topk_pools * kpool :] = tail.to(torch.int32)
    return out


ops.register("dsa_indexer_topk", ops.REFERENCE, indexer_topk_reference)


class IndexerProjections(NamedTuple):
    """What the indexer scores with: index_q [B,T,Hi,Di], pool_keys [B,P,Di], head_weights [B,T,Hi]
    fp32 (already times Hi^-0.5). The indexer's parameters act only through these three."""

    index_q: torch.Tensor
    pool_keys: torch.Tensor
    head_weights: torch.Tensor


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, cfg: IndexerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.wq_b = nn.Linear(q_lora_rank, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(hidden, cfg.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, cfg.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(cfg.kpool, cfg.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.ones(cfg.head_dim, hidden))

    def pool_keys(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] -> [B, T // kpool, head_dim]: the compressed keys of the complete pools."""
        kpool, head_dim = self.cfg.kpool, self.cfg.head_dim
        batch, seq = x.shape[:2]
        n_pools = seq // kpool
        usable = x[:, : n_pools * kpool]
        keys = self.k_norm(self.wk(usable)).view(batch, n_pools, kpool, head_dim)
        logits = F.linear(usable, self.index_kpool_compress_gate).view(batch, n_pools, kpool, head_dim)
        # Softmax over the tokens of a pool, separately per channel, in fp32.
        weights = (logits.float() + self.index_kpool_compress_ape.float()).softmax(dim=2).to(keys.dtype)
        return (weights * keys).sum(dim=2)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index_q [B,T,Hi,Di], head_weights fp32 [B,T,Hi]) of the tokens of x [B,T,hidden] and
        q_resid [B,T,q_lora_rank]: per token, so any slice of queries can be computed alone."""
        batch, seq = x.shape[:2]
        index_q = self.wq_b(q_resid).view(batch, seq, -1, self.cfg.head_dim)
        # Scaled by the configured head count, so a head-sliced indexer scores like the whole one.
        head_weights = self.weights_proj(x).float() * self.cfg.n_heads**-0.5
        return index_q, head_weights

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, piece: SequencePiece | None = None) -> IndexerProjections:
        """x: the attention input [B, T, hidden]; q_resid: the normed q latent [B, T, q_lora_rank].
        With a `piece` (context parallelism) the queries are the piece's and the pooled keys the whole
        sequence's: each piece pools its own (whole) pools, then they are gathered."""
        index_q, head_weights = self.queries(x, q_resid)
        pool_keys = self.pool_keys(x)
        if piece is not None:
            pool_keys = piece.gather(pool_keys)
        return IndexerProjections(index_q, pool_keys, head_weights)

    @property
    def softmax_scale(self) -> float:
        return self.cfg.head_dim**-0.5

    @torch.no_grad()
    def select(self, proj: IndexerProjections, query_offset: int = 0) -> torch.Tensor:
        """The top-k token indices int32 [B, T, W] (docs/ops.md "dsa_indexer_topk"); the queries sit
        at positions query_offset + [0, T) of the sequence the pooled keys cover."""
        return ops.call(
            "dsa_indexer_topk",
            self.layer_idx,
            proj.index_q,
            proj.pool_keys,
            proj.head_weights,
            kpool=self.cfg.kpool,
            topk_pools=self.cfg.topk_pools,
            always_select_tail=self.cfg.always_select_tail,
            softmax_scale=self.softmax_scale,
            query_offset=query_offset,
        )

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, piece: SequencePiece | None = None) -> torch.Tensor:
        """The frozen indexer: top-k indices, nothing kept for backward. With a `piece`: the piece's
        queries against the whole sequence's pools, indices global (see `project`)."""
        return self.select(self.project(x, q_resid, piece), query_offset=0 if piece is None else piece.offset)
