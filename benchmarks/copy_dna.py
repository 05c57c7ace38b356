"""Real DNA for the copy probes: rows of prepared-genome windows in place of random bases.

The copy probes (copy_task_probe.py, copy_indexer_arms.py) plant an L-mer's copy into rows of
bases. With `--dna PREPARED` those rows are windows of a real genome (`genolong prepare` output),
so the model must both model DNA and copy; the first occurrence then costs what real DNA costs
(1.97 bits per base for the copiers of docs/recall.md on phage lambda, not the 2 bits of random bases), which is the comparison
eval-recall makes (docs/recall.md).

Windows hold no N: a window with one is drawn again (the copy task's targets are the four bases;
an N would be a fifth symbol no copy can predict). Both strands are drawn.
"""

from __future__ import annotations

import numpy as np
import torch

from genolong.data import open_prepared
from genolong.data.sampler import WindowSampler


class DnaRows:
    """`rows(batch, n)`: a [batch, n] int64 tensor of N-free windows of `split`, a seeded stream."""

    def __init__(self, prepared: str, split: str = "train", seed: int = 0) -> None:
        self.pg = open_prepared(prepared)
        self.split, self.seed = split, int(seed)
        self._samplers: dict[int, WindowSampler] = {}
        self._drawn = 0

    def rows(self, batch: int, n: int) -> torch.Tensor:
        sampler = self._samplers.get(n)
        if sampler is None:  # one stream per row length (the arms score several lengths)
            sampler = WindowSampler(self.pg, self.split, n, seed=self.seed, max_n_fraction=0.0, reverse_complement=True)
            self._samplers[n] = sampler
        out = np.empty((batch, n), dtype=np.int64)
        for r in range(batch):
            out[r] = sampler.window(self._drawn).tokens  # max_n_fraction 0: the sampler admits no N
            self._drawn += 1
        return torch.from_numpy(out)
