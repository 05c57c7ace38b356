"""Scoring one window over the cp ranks of `eval-positional --parallel cp=N` (docs/parallel.md).

Every cp rank of a data-parallel rank scores the same window: the inputs and their targets
(shifted by one first, as in training) are padded at the end to a length that splits into whole
context shards, each rank runs the context-parallel model (genolong.parallel.context) on its
contiguous shard, and the per-target losses are gathered and the padding cut off. The model is
causal, so tokens appended after the last input change no loss before them: the scores are the
one-process scores up to rounding, at any window or control length.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from genolong.eval.positional import ModelScorer
from genolong.parallel.context import gather_sequence, shard_slice


class ContextParallelScorer(ModelScorer):
    """A ModelScorer whose model has had `apply_context_parallel` on `pmesh` (module docstring).
    `granule`: each shard's length must be a multiple of it (whole KDA chunks and indexer pools)."""

    def __init__(self, model: torch.nn.Module, token_map: np.ndarray, pmesh, *, granule: int, **kwargs) -> None:
        super().__init__(model, token_map, **kwargs)
        self.group, self.rank, self.size = pmesh.group("cp"), pmesh.rank("cp"), pmesh.size("cp")
        self.granule = granule

    @torch.inference_mode()
    def losses(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        length = inputs.shape[1]
        block = self.size * self.granule
        padding = -length % block
        # Any token does as padding (its losses are cut off); a scored base keeps the ids valid for every loss.
        fill = int(self.token_map[0])
        inputs, targets = (F.pad(t, (0, padding), value=fill) for t in (inputs, targets))
        mine = shard_slice(length + padding, self.rank, self.size, self.granule)
        loss = self.target_losses(inputs[:, mine].contiguous(), targets[:, mine].contiguous()).float()
        return gather_sequence(loss, self.group)[:, :length].cpu()
