"""Windows of a prepared split: a seeded, resumable random sampler for training and an ordered
tiling for evaluation.

Window k of a sampler is drawn from its own generator seeded with (seed, k), so the sampler's
whole state is the count of windows yielded: resuming from `state_dict()` yields exactly the
windows an uninterrupted sampler would have, and data-parallel ranks take interleaved k.
"""

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from genolong.data.prepared import PreparedGenome
from genolong.errors import GenolongError
from genolong.units import format_length, parse_length
from genolong.vocab import COMPLEMENT_ID, N_ID

MAX_TRIES = 1000
_COMPLEMENT = np.array(COMPLEMENT_ID + tuple(range(len(COMPLEMENT_ID), 256)), dtype=np.uint8)
_STATE_VERSION = 1


@dataclass(frozen=True)
class Window:
    """`tokens`/`repeat_mask` are the window's own writable arrays; `start` is on the forward strand."""

    tokens: np.ndarray
    repeat_mask: np.ndarray
    record: str
    start: int
    reverse: bool = False


def reverse_complement(tokens: np.ndarray, repeat_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _COMPLEMENT[tokens[::-1]], repeat_mask[::-1].copy()


def _check_fraction(max_n_fraction: float) -> float:
    value = float(max_n_fraction)
    if not 0.0 <= value <= 1.0:
        raise GenolongError(f"max_n_fraction must be between 0 and 1, got {max_n_fraction!r}")
    return value


def _acceptable(tokens: np.ndarray, max_n_fraction: float) -> bool:
    """An all-N window is never acceptable: it has no base to learn from (and would give NaN losses)."""
    n = int(np.count_nonzero(tokens == N_ID))
    return n < tokens.size and n <= max_n_fraction * tokens.size


def _long_enough(pg: PreparedGenome, split: str, length: int) -> list[tuple[str, int]]:
    records = pg.records(split)
    eligible = [(name, n) for name, n in records if n >= length]
    if not eligible:
        name, n = max(records, key=lambda r: r[1])
        raise GenolongError(
            f"no record in split {split!r} of {str(pg.path)!r} has {format_length(length)} ({length:,}) bases; "
            f"the longest is {name!r} with {n:,}: use a window length <= {n:,} or put longer records in that split"
        )
    return eligible


class WindowSampler:
    """Endless random windows of `length` bases from `split`; see docs/data.md for the semantics."""

    def __init__(
        self,
        pg: PreparedGenome,
        split: str = "train",
        length: int | str = 524288,
        seed: int = 0,
        max_n_fraction: float = 0.5,
        reverse_complement: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise GenolongError(f"rank {rank} is not in [0, world_size={world_size})")
        self.pg = pg
        self.split = split
        self.length = parse_length(length, "window length")
        self.seed = int(seed)
        self.max_n_fraction = _check_fraction(max_n_fraction)
        self.reverse_complement = bool(reverse_complement)
        self.rank, self.world_size = rank, world_size
        self._records = _long_enough(pg, split, self.length)
        # Record chosen in proportion to its number of window starts: every valid window is equally likely.
        starts = np.array([n - self.length + 1 for _, n in self._records], dtype=np.int64)
        self._cum = np.cumsum(starts)
        self._yielded = 0

    def window(self, k: int) -> Window:
        """The k-th window of the (seed, split, length, ...) stream, independent of all others."""
        rng = np.random.Generator(np.random.PCG64([self.seed, k]))
        for _ in range(MAX_TRIES):
            pos = int(rng.integers(0, self._cum[-1]))
            i = int(np.searchsorted(self._cum, pos, side="right"))
            start = pos - (int(self._cum[i - 1]) if i else 0)
            reverse = bool(rng.integers(2)) if self.reverse_complement else False
            name = self._records[i][0]
            tokens, mask = self.pg.read(self.split, name, start, self.length)
            if _acceptable(tokens, self.max_n_fraction):
                if reverse:
                    tokens, mask = reverse_complement(tokens, mask)
                else:
                    tokens, mask = tokens.copy(), mask.copy()
                return Window(tokens, mask, name, start, reverse)
        found = f"no window of {format_length(self.length)} bases"
        if self.max_n_fraction >= 1.0:
            # Only all-N windows are refused: raising the limit cannot help.
            raise GenolongError(
                f"{found} with any base other than N found in split {self.split!r} after {MAX_TRIES} tries: "
                "the split is (almost) all N; prepare it from records with sequence"
            )
        raise GenolongError(
            f"{found} with at most {self.max_n_fraction:.0%} N found in split {self.split!r} after {MAX_TRIES} tries: "
            f"raise --max-n-fraction (now {self.max_n_fraction:g}) or use a shorter --seq"
        )

    def __iter__(self) -> Iterator[Window]:
        while True:
            window = self.window(self._yielded * self.world_size + self.rank)
            self._yielded += 1
            yield window

    def _identity(self) -> dict:
        records = hashlib.sha256(repr(self._records).encode()).hexdigest()[:16]
        return {
            "version": _STATE_VERSION,
            "split": self.split,
            "length": self.length,
            "seed": self.seed,
            "max_n_fraction": self.max_n_fraction,
            "reverse_complement": self.reverse_complement,
            "rank": self.rank,
            "world_size": self.world_size,
            "records": records,
        }

    def state_dict(self) -> dict:
        return {**self._identity(), "windows_yielded": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        mine = self._identity()
        diff = [f"{k}={state.get(k)!r} (now {v!r})" for k, v in mine.items() if state.get(k) != v]
        if diff:
            raise GenolongError(
                f"sampler state was saved with other data settings: {', '.join(diff)}; resume with the same "
                f"prepared data and window options, or start a fresh run"
            )
        self._yielded = int(state["windows_yielded"])


def tile_windows(
    pg: PreparedGenome,
    split: str = "holdout",
    length: int | str = 524288,
    max_windows: int | None = None,
    max_n_fraction: float = 1.0,
) -> Iterator[Window]:
    """Windows at 0, L, 2L, ... of each record in order (a partial last window is dropped).

    All-N windows are always skipped, and windows above `max_n_fraction` N; positions stay on the
    fixed grid, so a window's `start` says where it lies whichever windows were skipped.
    """
    size = parse_length(length, "window length")
    fraction = _check_fraction(max_n_fraction)
    if max_windows is not None and max_windows <= 0:
        raise GenolongError(f"max_windows must be positive, got {max_windows}")
    records = _long_enough(pg, split, size)

    def tiles() -> Iterator[Window]:
        yielded = 0
        for name, n in records:
            for start in range(0, n - size + 1, size):
                tokens, mask = pg.read(split, name, start, size)
                if not _acceptable(tokens, fraction):
                    continue
                yield Window(tokens.copy(), mask.copy(), name, start, False)
                yielded += 1
                if max_windows is not None and yielded >= max_windows:
                    return

    return tiles()
