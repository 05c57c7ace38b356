"""Dinucleotide-preserving shuffle: a random sequence with exactly the same letter-pair counts.

The distant-context control replaces the context far from a target by shuffled DNA of the same
length. A plain shuffle would keep base composition but change CpG depletion and every other
neighbour statistic, so a model could tell real from shuffled context by its local texture. A
dinucleotide shuffle keeps the first letter, the last letter and the count of every ordered pair
of neighbours (AA, AC, ..., NN), and destroys everything longer-range.

Method (Altschul and Erickson 1985, in the form of Kandel et al. 1996): the sequence is an
Eulerian path through the multigraph whose vertices are letters and whose edges are its
neighbour pairs. Every vertex except the final letter picks one of its out-edges at random as
its *last* exit; if those last exits form a tree leading to the final letter, any order of the
remaining edges yields a valid Eulerian path, so the other out-edges of each vertex are put in a
random order and the path is walked. Otherwise the last exits are drawn again. This samples
uniformly among sequences with the same pair counts, first and last letter.
"""

from __future__ import annotations

import numpy as np


def dinucleotide_shuffle(seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random permutation of `seq` (1-D integer array) with the same first letter, last letter and
    counts of every ordered neighbour pair. Sequences shorter than 3 are returned as copies."""
    seq = np.asarray(seq)
    if seq.ndim != 1:
        raise ValueError(f"dinucleotide_shuffle takes a 1-D sequence, got shape {seq.shape}")
    if len(seq) < 3:
        return seq.copy()
    letters, codes = np.unique(seq, return_inverse=True)
    m = len(letters)
    src, dst = codes[:-1], codes[1:]
    order = np.argsort(src, kind="stable")
    successors = dst[order]  # the out-edges of vertex v are successors[bounds[v]:bounds[v + 1]]
    bounds = np.searchsorted(src[order], np.arange(m + 1))
    final = int(codes[-1])

    last_exit = _draw_last_exits(successors, bounds, final, rng)
    edges: list[list[int]] = []
    for v in range(m):
        slots = np.arange(bounds[v], bounds[v + 1])
        if v in last_exit:
            rest = slots[slots != last_exit[v]]
            slots = np.append(rng.permutation(rest), last_exit[v])
        else:
            slots = rng.permutation(slots)
        edges.append(successors[slots].tolist())
    return letters[_walk(int(codes[0]), edges, len(seq))]


def _draw_last_exits(successors: np.ndarray, bounds: np.ndarray, final: int, rng: np.random.Generator) -> dict[int, int]:
    """For every vertex with out-edges other than `final`: the slot of its last exit, such that
    following last exits from any vertex reaches `final` (a spanning arborescence)."""
    m = len(bounds) - 1
    while True:
        last_exit = {
            v: int(bounds[v] + rng.integers(bounds[v + 1] - bounds[v]))
            for v in range(m)
            if v != final and bounds[v + 1] > bounds[v]
        }
        if all(_reaches(v, last_exit, successors, final) for v in last_exit):
            return last_exit


def _reaches(v: int, last_exit: dict[int, int], successors: np.ndarray, final: int) -> bool:
    seen = set()
    while v != final:
        if v in seen or v not in last_exit:
            return False
        seen.add(v)
        v = int(successors[last_exit[v]])
    return True


def _walk(start: int, edges: list[list[int]], n: int) -> np.ndarray:
    """Follow each vertex's out-edges in list order; the walk uses every edge exactly once."""
    taken = [0] * len(edges)
    current = start
    path = [current]
    append = path.append
    for _ in range(n - 1):
        k = taken[current]
        taken[current] = k + 1
        current = edges[current][k]
        append(current)
    return np.asarray(path, dtype=np.int64)
