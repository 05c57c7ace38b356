"""DSA under context parallelism: own queries against the gathered keys, the indexer balanced by zigzag.

`ContextParallelDSA` runs the model's own DSA forward with a `SequencePiece` (genolong/model/
piece.py): each rank projects its queries, its latent and its pooled indexer keys (the shard is
pool-aligned, so every rank pools whole pools of its own), all-gathers the latent and the pooled
keys (their gradients reduce-scattered back), scores its queries against every pool with the
indexer op's `query_offset` (selections are global positions), and runs sparse attention over
the gathered latent. The indexer's KL loss and recall probe read the same gathered tensors and
normalise over the whole sequence's queries.

Load balance: sparse attention and everything else in the layer cost the same per query
wherever it sits, but the indexer scores a query against every pool before it, so with
contiguous shards rank r's scoring work grows as 2r + 1 (the last rank does (2cp - 1) / cp^2
of all of it). `BalancedIndexer` rebalances only that: the sequence is cut into 2 cp blocks,
rank r owns blocks 2r and 2r + 1 (its shard) but *scores* blocks r and 2cp - 1 - r (zigzag:
one early and one late block each, equal work), so the owners send the scorers their index
queries and head weights, and the scorers send back the int32 selections. Measured on the CPU
reference at 16k tokens (docs/parallel.md): the slowest rank's scoring time falls by a third
at cp=2 and by 40% at cp=4.
"""

from __future__ import annotations

import torch

from genolong.errors import GenolongError
from genolong.model.dsa import DSAAttention
from genolong.model.indexer import Indexer, IndexerProjections
from genolong.model.piece import SequencePiece
from genolong.parallel.collectives import exchange
from genolong.parallel.context_group import ContextGroup


class ContextParallelDSA(DSAAttention):
    """DSA on this rank's queries against the whole sequence's latent and pooled keys (module docstring)."""

    cp: ContextGroup

    def forward(self, x: torch.Tensor, topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.indexer is not None and x.shape[1] % self.indexer.cfg.kpool:
            raise GenolongError(
                f"layer {self.layer_idx}: a context shard of {x.shape[1]} tokens cuts an indexer pool of "
                f"{self.indexer.cfg.kpool}; use a sequence length that genolong.parallel.layout.required_multiple accepts"
            )
        return super().forward(x, topk, piece=self.cp.piece(x.shape[1]))

    def extra_repr(self) -> str:
        return f"{self.cp}, own queries against the gathered latent and pooled keys"


class BalancedIndexer(Indexer):
    """The indexer of a context-parallel DSA layer, its scoring balanced by zigzag blocks (module docstring)."""

    cp: ContextGroup

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, piece: SequencePiece | None = None) -> torch.Tensor:
        if piece is None:
            return super().forward(x, q_resid)
        rows = x.shape[1]
        if rows % 2:
            raise GenolongError(f"layer {self.layer_idx}: a context shard of {rows} tokens does not split into two scoring blocks")
        proj = self.project(x, q_resid, piece)
        plan = ZigzagPlan(self.cp.rank, self.cp.size, rows // 2)

        def score(index_q, head_weights, offset):
            return self.select(IndexerProjections(index_q, proj.pool_keys, head_weights), query_offset=offset)

        return plan.select(score, proj.index_q, proj.head_weights, self.cp.group)

    def extra_repr(self) -> str:
        return f"{self.cp}, scores zigzag blocks of queries"


class ZigzagPlan:
    """Who scores which block of queries: 2 x size blocks of `block` tokens; rank r owns blocks 2r
    and 2r + 1 and scores blocks r and 2 size - 1 - r. Tensors move as [B, tokens, ...]."""

    def __init__(self, rank: int, size: int, block: int) -> None:
        self.rank, self.size, self.block = rank, size, block
        scorer = lambda b: b if b < size else 2 * size - 1 - b  # noqa: E731
        own = (2 * rank, 2 * rank + 1)
        # What this rank sends, grouped by destination rank in order (an all-to-all's layout).
        self.sent = [b for dest in range(size) for b in own if scorer(b) == dest]
        self.send_counts = [block * sum(scorer(b) == dest for b in own) for dest in range(size)]
        mine = sorted({rank, 2 * size - 1 - rank})
        self.received = [b for src in range(size) for b in mine if b // 2 == src]
        self.recv_counts = [block * sum(b // 2 == src for b in mine) for src in range(size)]

    def _local(self, t: torch.Tensor, b: int) -> torch.Tensor:
        start = (b - 2 * self.rank) * self.block
        return t[:, start : start + self.block]

    def to_scorers(self, t: torch.Tensor, group) -> torch.Tensor:
        """This rank's [B, 2 block, ...] -> the blocks it scores, [B, 2 block, ...] in `received` order."""
        send = torch.cat([self._local(t, b) for b in self.sent], dim=1).transpose(0, 1).contiguous()
        return exchange(send, self.send_counts, self.recv_counts, group).transpose(0, 1)

    def scored_blocks(self, index_q: torch.Tensor, head_weights: torch.Tensor):
        """(index_q, head_weights, query_offset) of each block this rank scores."""
        for i, b in enumerate(self.received):
            part = slice(i * self.block, (i + 1) * self.block)
            yield index_q[:, part], head_weights[:, part], b * self.block

    def select(self, score, index_q: torch.Tensor, head_weights: torch.Tensor, group) -> torch.Tensor:
        """This rank's selections [B, 2 block, W]: its queries go to their scorers, `score(index_q,
        head_weights, query_offset)` runs on the blocks this rank scores, the selections come back.

        The selections are the big tensor here (2051 int32 per query: 4 GiB per 512k tokens), so
        they are written into one buffer as each block is scored, the buffer is freed once sent, and
        the returned rows are put in order in place: at most two copies exist at a time."""
        index_q, head_weights = self.to_scorers(index_q, group), self.to_scorers(head_weights, group)
        scored = None
        for i, (q_b, w_b, offset) in enumerate(self.scored_blocks(index_q, head_weights)):
            block = score(q_b, w_b, offset)
            if scored is None:
                scored = block.new_empty(block.shape[0], len(self.received) * self.block, block.shape[2])
            scored[:, i * self.block : (i + 1) * self.block] = block
            del block
        del index_q, head_weights
        back = exchange(scored.transpose(0, 1).contiguous(), self.recv_counts, self.send_counts, group)
        del scored
        back = back.transpose(0, 1)  # [B, 2 block, W]: this rank's blocks in `sent` order
        if self.sent != sorted(self.sent):  # the later own block came back first: swap the halves
            first = back[:, : self.block].clone()
            back[:, : self.block] = back[:, self.block :]
            back[:, self.block :] = first
        return back.contiguous()  # (a copy only for B > 1)
