"""What eval-recall's scoring (genolong.eval.recall), aggregation (recall_report) and plot
(recall_plot) share: the validated layout of the planted copies, the losses scored per copy base,
and the aggregated results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from genolong.errors import GenolongError
from genolong.eval.report import MIN_WINDOWS, Estimate
from genolong.units import format_length

# Axis 1 of RecallLayout's per-window sums.
KINDS = ("copy", "first", "null", "scrambled")


@dataclass(frozen=True)
class RecallLayout:
    """Window length, copy length, distances and skipped leading copy bases, validated together."""

    seq: int
    length: int
    distances: tuple[int, ...]
    skip: int = 16

    def __post_init__(self) -> None:
        if self.length < 2:
            raise GenolongError(f"--len {self.length}: a copy needs at least 2 bases; use e.g. --len 64")
        if not 0 <= self.skip < self.length:
            raise GenolongError(f"--skip {self.skip} must be in [0, --len {self.length}): the headline averages offsets skip..len-1")
        if not self.distances:
            raise GenolongError("--distances is empty: give distances like 1k,4k,16k,48k")
        if len(set(self.distances)) != len(self.distances) or list(self.distances) != sorted(self.distances):
            raise GenolongError(f"--distances {self.distances} must be increasing and without repeats")
        if self.distances[0] < self.length:
            raise GenolongError(
                f"--distances {self.distances[0]} is shorter than --len {self.length}: the copy would overlap its first "
                f"occurrence; use distances >= {self.length}"
            )
        longest = self.distances[-1]
        if longest + self.length >= self.seq:
            raise GenolongError(
                f"--distances {format_length(longest)} with --len {self.length} needs windows of more than "
                f"{longest + self.length:,} bases, and --seq is {self.seq:,}: use distances up to "
                f"{self.seq - self.length - 1:,} or a longer --seq"
            )
        if 2 * self.length * len(self.distances) > self.seq // 2:
            raise GenolongError(
                f"{len(self.distances)} distances x 2 x --len {self.length} bases would fill over half of a {self.seq:,}-base "
                "window: use fewer distances, a shorter --len or a longer --seq"
            )

    @classmethod
    def auto_distances(cls, seq: int, length: int) -> tuple[int, ...]:
        """seq/64, seq/16, seq/4 and 3/4 seq (64k -> 1k, 4k, 16k, 48k), those >= length."""
        picks = (seq // 64, seq // 16, seq // 4, 3 * seq // 4)
        return tuple(sorted({d for d in picks if d >= length and d + length < seq}))



LOW_WINDOWS = MIN_WINDOWS  # fewer windows than this: percentile intervals run narrow (said in every output)


@dataclass
class RecallResults:
    layout: RecallLayout
    windows: list[tuple[str, int, bool]]
    labels: dict[str, str]  # role -> label, in scoring order
    n_bases: np.ndarray  # [distances]: scored copy bases (offsets >= skip) over all windows
    loss: dict[tuple[str, str], Estimate]  # (role, kind) -> nats per distance
    recall: dict[tuple[str, str], Estimate]  # (role, name in recall_report.RECALLS) -> per distance
    offsets: dict[tuple[str, str], Estimate]  # (role, kind) -> nats [distances, length]
    meta: dict[str, Any]

    @property
    def low_windows(self) -> bool:
        return len(self.windows) < LOW_WINDOWS
