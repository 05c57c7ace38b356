"""How a layer sees its input when each sequence is split into pieces (context parallelism).

The plain model sees whole sequences and never builds one of these. Context parallelism
(genolong/parallel/context.py) passes one to each DSA layer call: where this piece sits in its
sequence, how long the whole sequence is, and two functions that reach the other pieces. So the
layer code holds no process group, and with `piece=None` it is exactly the single-device layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequencePiece:
    """offset: position of the piece's first token in its sequence; length: the whole sequence's
    length; gather(t): the whole sequence of a per-token tensor t [B, piece, ...] (along dim 1, in
    order), whose gradient is summed back to each piece; total(t): a metric summed over the pieces
    (no gradient)."""

    offset: int
    length: int
    gather: Callable[[torch.Tensor], torch.Tensor]
    total: Callable[[torch.Tensor], torch.Tensor]
