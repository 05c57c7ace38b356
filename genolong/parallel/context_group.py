"""The cp group a context-parallel mixer talks to (genolong/parallel/context.py switches the mixers;
context_kda.py and context_dsa.py are the switched classes, and all three use this)."""

from __future__ import annotations

from genolong.model.piece import SequencePiece
from genolong.parallel.collectives import gather_along, reduce_sum


class ContextGroup:
    """The cp group a switched mixer talks to, and this rank's place in it."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def piece(self, local_len: int) -> SequencePiece:
        """What a layer needs to know about a shard of `local_len` tokens (genolong/model/piece.py)."""
        return SequencePiece(
            offset=self.rank * local_len,
            length=self.size * local_len,
            gather=lambda t: gather_along(t, 1, self.group),
            total=lambda t: reduce_sum(t.detach(), self.group),
        )

    def __repr__(self) -> str:
        return f"cp rank {self.rank} of {self.size}"
