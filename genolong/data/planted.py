"""Planted repeats: a segment of a real window copied d bases further on.

A planted copy takes the L bases [s, s+L) of a window and writes them over [s+d, s+d+L). A
model that uses context at distance d can predict the copy (after its first few bases) almost
perfectly; one that does not scores it like any other DNA. Used by `genolong eval-recall`
(genolong/eval/recall.py) and, with `finetune --planted-repeats SPEC`, for training
(docs/recall.md).

Rules, the same for training and evaluation:
- the copy overwrites the window; the source is left as it was;
- the sources and copies of one window never overlap each other (each copy's source is intact
  real DNA and no copy is damaged by a later one), and d >= L (a copy never overlaps its own
  source);
- neither the source nor the bases the copy replaces hold an N (the copy is pure DNA, and the
  unplanted window's bases at the copy's place are a valid "ordinary DNA" null);
- the repeat mask of the copy is the source's mask: the copy is the same sequence, and
  soft-masking marks sequence families (a planted segmental duplication is not soft-masked by
  RepeatMasker either), so options that weight soft-masked bases treat both occurrences alike;
- placement is a pure function of (seed, record, start, strand) of the window, so a resumed
  run plants exactly what an uninterrupted one would, with no state of its own;
- `mutate=F` diverges each copy from its source: every base of the copy is, with probability F,
  replaced by one of the three other bases (drawn after the placement, from the same window
  generator), the way natural repeats (transposon copies, old duplications) differ from their
  sources. The placement is the unmutated spec's.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from genolong.data.sampler import Window
from genolong.errors import GenolongError
from genolong.units import format_length, parse_length
from genolong.vocab import N_ID

PLACE_TRIES = 200  # random starts tried per copy before giving up on it


@dataclass(frozen=True)
class PlantedCopy:
    """Bases [source, source + length) copied to [dest, dest + length), window coordinates."""

    source: int
    distance: int
    length: int

    @property
    def dest(self) -> int:
        return self.source + self.distance


@dataclass(frozen=True)
class PlantedWindow(Window):
    """A window with its planted copies; `original` holds the tokens before planting."""

    copies: tuple[PlantedCopy, ...] = ()
    original: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PlantSpec:
    """What to plant per window: `per_window` copies of `length` bases, at distances drawn
    log-uniformly in [min_distance, max_distance] or uniformly from `distances`."""

    length: int = 64
    per_window: int = 8
    max_distance: int | None = None
    min_distance: int | None = None  # None = length (the shortest distance with no self-overlap)
    distances: tuple[int, ...] = ()
    seed: int | None = None  # None = the run's seed
    mutate: float = 0.0  # substitution rate of each copy against its source

    @classmethod
    def parse(cls, text: str) -> PlantSpec:
        """`len=64,max-dist=48k,per-window=8[,min-dist=1k][,seed=3][,mutate=0.05]` or `len=64,dist=1k/4k/16k,...`."""
        keys = {
            "len": "length", "per-window": "per_window", "max-dist": "max_distance", "min-dist": "min_distance",
            "dist": "distances", "seed": "seed", "mutate": "mutate",
        }
        fields: dict = {}
        for part in str(text).split(","):
            name, sep, value = part.strip().partition("=")
            if not sep or name not in keys or not value.strip():
                raise GenolongError(
                    f"--planted-repeats {text!r}: cannot read {part.strip()!r}; write KEY=VALUE pairs separated by commas with keys "
                    f"{', '.join(keys)}, e.g. len=64,max-dist=48k,per-window=8"
                )
            what = f"--planted-repeats {name}"
            if name == "dist":
                fields["distances"] = tuple(parse_length(v, what) for v in value.split("/"))
            elif name == "seed":
                try:
                    fields["seed"] = int(value)
                except ValueError:
                    raise GenolongError(f"--planted-repeats seed={value!r} is not an integer") from None
            elif name == "mutate":
                try:
                    fields["mutate"] = float(value)
                except ValueError:
                    raise GenolongError(f"--planted-repeats mutate={value!r} is not a number; give a substitution rate such as 0.05") from None
            else:
                fields[keys[name]] = parse_length(value, what)
        return cls(**fields).validate()

    def validate(self, window: int | None = None) -> PlantSpec:
        """Refuse specs that cannot work; with `window`, also those whose copies cannot fit in it."""
        if self.length < 1 or self.per_window < 1:
            raise GenolongError(f"--planted-repeats: len and per-window must be positive, got {self.length} and {self.per_window}")
        if not 0.0 <= self.mutate < 0.75:
            # 0.75 substitutions per base is what two unrelated sequences differ by: nothing left to copy.
            raise GenolongError(f"--planted-repeats: mutate={self.mutate} is not a substitution rate in [0, 0.75); e.g. mutate=0.05")
        if bool(self.distances) == (self.max_distance is not None):
            raise GenolongError("--planted-repeats needs exactly one of max-dist=D (log-uniform distances) or dist=D1/D2/... (a list)")
        if self.distances and self.min_distance is not None:
            raise GenolongError("--planted-repeats: min-dist goes with max-dist, not with a dist= list")
        shortest = min(self.distances) if self.distances else self.lowest_distance
        if shortest < self.length:
            raise GenolongError(
                f"--planted-repeats: distance {shortest} is shorter than len={self.length}, so the copy would overlap its own "
                f"source; use distances >= {self.length}"
            )
        if self.max_distance is not None and self.max_distance < self.lowest_distance:
            raise GenolongError(f"--planted-repeats: max-dist={self.max_distance} is below min-dist={self.lowest_distance}")
        if window is not None and self.longest_distance + self.length >= window:
            raise GenolongError(
                f"--planted-repeats: a copy {format_length(self.longest_distance)} after a {self.length}-base source needs windows "
                f"of more than {self.longest_distance + self.length:,} bases, and these have {window:,}: lower max-dist "
                f"to at most {window - self.length - 1:,} or use a longer --seq"
            )
        return self

    @property
    def lowest_distance(self) -> int:
        return min(self.distances) if self.distances else (self.min_distance or self.length)

    @property
    def longest_distance(self) -> int:
        return max(self.distances) if self.distances else int(self.max_distance)

    def describe(self) -> str:
        """The canonical spec string (what `parse` reads back)."""
        parts = [f"len={self.length}", f"per-window={self.per_window}"]
        if self.distances:
            parts.append("dist=" + "/".join(str(d) for d in self.distances))
        else:
            parts += [f"min-dist={self.lowest_distance}", f"max-dist={self.max_distance}"]
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        if self.mutate:
            parts.append(f"mutate={self.mutate:g}")
        return ",".join(parts)

    def draw_distances(self, rng: np.random.Generator) -> list[int]:
        if self.distances:
            return [int(d) for d in rng.choice(np.array(self.distances), size=self.per_window)]
        lo, hi = math.log(self.lowest_distance), math.log(self.longest_distance)
        return [min(self.longest_distance, max(self.lowest_distance, round(math.exp(x)))) for x in rng.uniform(lo, hi, self.per_window)]


def window_rng(seed: int, window: Window) -> np.random.Generator:
    """The generator of one window's planting: a function of (seed, record, start, strand) only."""
    record = int.from_bytes(hashlib.sha256(window.record.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64([int(seed), record, int(window.start), int(window.reverse)]))


def place(tokens: np.ndarray, distances: Sequence[int], length: int, rng: np.random.Generator) -> list[PlantedCopy]:
    """Non-overlapping places for one copy per distance (longest first: they have the fewest
    choices); a distance with no free N-free place after PLACE_TRIES draws is left out."""
    size = len(tokens)
    is_n = np.asarray(tokens) == N_ID
    n_before = np.concatenate([[0], np.cumsum(is_n)])  # N count of [a, b) = n_before[b] - n_before[a]
    taken: list[tuple[int, int]] = []
    copies = []
    for d in sorted(distances, reverse=True):
        # Source start >= 1: target 0 has no context, so a source there could not be scored whole.
        last = size - d - length
        if last < 1:
            continue
        for _ in range(PLACE_TRIES):
            s = int(rng.integers(1, last + 1))
            spans = ((s, s + length), (s + d, s + d + length))
            if any(n_before[b] - n_before[a] for a, b in spans):
                continue
            if any(a < tb and ta < b for a, b in spans for ta, tb in taken):
                continue
            taken.extend(spans)
            copies.append(PlantedCopy(s, int(d), length))
            break
    return sorted(copies, key=lambda c: c.source)


def apply(tokens: np.ndarray, repeat_mask: np.ndarray, copies: Sequence[PlantedCopy]) -> tuple[np.ndarray, np.ndarray]:
    """New arrays with every copy written over its destination (sources are never destinations)."""
    out, mask = np.array(tokens, copy=True), np.array(repeat_mask, copy=True)
    for c in copies:
        out[c.dest : c.dest + c.length] = tokens[c.source : c.source + c.length]
        mask[c.dest : c.dest + c.length] = repeat_mask[c.source : c.source + c.length]
    return out, mask


def diverge(tokens: np.ndarray, copies: Sequence[PlantedCopy], rate: float, rng: np.random.Generator) -> np.ndarray:
    """The planted tokens with each base of every copy substituted, with probability `rate`, by one
    of the three other bases (copies and sources hold no N, see `place`)."""
    out = np.array(tokens, copy=True)
    for c in copies:
        hit = rng.random(c.length) < rate
        shift = rng.integers(1, 4, size=c.length)  # 1-3: another base of A, C, G, T (ids 0-3)
        span = out[c.dest : c.dest + c.length]
        span[hit] = (span[hit] + shift[hit]) % 4
    return out


def plant_window(
    window: Window, distances: Sequence[int], length: int, rng: np.random.Generator, mutate: float = 0.0
) -> PlantedWindow:
    copies = place(window.tokens, distances, length, rng)
    tokens, mask = apply(window.tokens, window.repeat_mask, copies)
    if mutate:
        tokens = diverge(tokens, copies, mutate, rng)
    return PlantedWindow(tokens, mask, window.record, window.start, window.reverse, tuple(copies), window.tokens)


SCRAMBLE_STREAM = 0x5C4A  # keeps the scrambling draws apart from the placement draws of the same window
SCRAMBLE_TRIES = 100  # permutations drawn per source before accepting one that leaves it unchanged


def scramble_sources(planted: PlantedWindow, seed: int) -> tuple[np.ndarray, int]:
    """The planted tokens with every copy's source replaced by a shuffle of its own bases, and the
    number of sources that no shuffle could change (a single repeated base).

    The control of eval-recall: the copy keeps its place and its bases, the bases before it are
    the same, but its earlier occurrence is gone; a shuffle keeps the source's composition, so
    whatever the model learns from the base mix of the window is left as it was. Sources never
    hold an N and never overlap another copy's source or copy, so nothing else changes. A pure
    function of (seed, record, start, strand), like the placement.
    """
    record = int.from_bytes(hashlib.sha256(planted.record.encode()).digest()[:8], "little")
    rng = np.random.Generator(np.random.PCG64([int(seed), record, int(planted.start), int(planted.reverse), SCRAMBLE_STREAM]))
    out = np.array(planted.tokens, copy=True)
    unchanged = 0
    for c in planted.copies:
        source = planted.tokens[c.source : c.source + c.length]
        shuffled = source
        # A shuffle that happens to give the source back would leave its earlier occurrence in place.
        for _ in range(SCRAMBLE_TRIES if len(np.unique(source)) > 1 else 0):
            shuffled = source[rng.permutation(c.length)]
            if not np.array_equal(shuffled, source):
                break
        out[c.source : c.source + c.length] = shuffled
        unchanged += bool(np.array_equal(shuffled, source))
    return out, unchanged


class PlantedRepeatSampler:
    """A WindowSampler whose windows carry planted copies (`finetune --planted-repeats`).

    Its state is the wrapped sampler's plus the spec (checked on resume): planting needs no
    state of its own (see the module docstring), so resuming stays bit-exact.
    """

    def __init__(self, base, spec: PlantSpec, seed: int) -> None:
        self.base = base
        self.spec = spec.validate(window=base.length)
        self.seed = int(spec.seed if spec.seed is not None else seed)

    @property
    def length(self) -> int:
        return self.base.length

    def plant(self, window: Window) -> PlantedWindow:
        rng = window_rng(self.seed, window)
        return plant_window(window, self.spec.draw_distances(rng), self.spec.length, rng, self.spec.mutate)

    def __iter__(self) -> Iterator[PlantedWindow]:
        for window in self.base:
            yield self.plant(window)

    def _identity(self) -> dict:
        return {"planted_repeats": self.spec.describe(), "planted_seed": self.seed}

    def state_dict(self) -> dict:
        return {**self.base.state_dict(), **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        mine = self._identity()
        diff = [f"{k}={state.get(k)!r} (now {v!r})" for k, v in mine.items() if state.get(k) != v]
        if diff:
            raise GenolongError(
                f"sampler state was saved with other planted repeats: {', '.join(diff)}; resume with the same "
                "--planted-repeats, or start a fresh run"
            )
        self.base.load_state_dict(state)
