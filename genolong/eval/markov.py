"""The k-mer Markov baseline: p(base | the k bases before it), counted on the train split.

A language model of DNA is worth its compute only where it beats this yardstick. For each order
k in 0..K the model counts, over the train split, how often each base follows each k-mer, and
predicts with add-alpha smoothing:

    p(b | context) = (n(context, b) + alpha) / (n(context) + 4 alpha)

Order and alpha are chosen by bits/base on a validation set: prepare's `--validation` split, or,
when the data has none, the last 10% of every train record (held out from the counts while
choosing, added back afterwards; the summary says which). Every candidate order is judged on the
same validation targets (those with K valid bases before them).

N bases: a context never contains N. Counting skips targets whose k bases before them hold an
N (or cross the start of a record); scoring backs off to the longest N-free context inside the
window, so a target right after an N run or at the start of a window is predicted by a lower
order (the models, too, see only the window). N targets are not scored.

Cost: one vectorised pass over the train split (the top order's k-mer codes, added into its
count table with `np.add.at`; lower orders are sums of higher ones), linear in the bases. Counts are int64
tables of 4^k x 4 (order 12: 512 MiB), so K is capped where the table would exceed 1 GiB and
where 4^k exceeds the train bases (contexts seen less than once on average). Choosing scores
at most 4 Mb of the validation set (evenly spaced 1 Mb pieces). The fit is cached in the eval
output directory (`markov.npz`), so a rerun does not refit.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from genolong.errors import GenolongError

N_BASES = 4
DEFAULT_MAX_ORDER = 12
DEFAULT_ALPHAS = (0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 20.0)
MAX_TABLE_BYTES = 1 << 30
VALIDATION_FRACTION = 0.1
VALIDATION_MAX_BASES = 4 << 20
CACHE_NAME = "markov.npz"
_FORMAT = 2  # 2: the added-back validation slice counted with its look-back (2026-12-05)
LN2 = math.log(2.0)
_BLOCK = 1 << 23  # bases per vectorised block: bounds the temporaries at ~0.5 GB


@dataclass
class MarkovModel:
    """Counts of orders 0..order (counts[k]: int64 [4^k, 4], row = k-mer code, oldest base most
    significant) and the smoothing constant; `info` says how it was fitted."""

    counts: list[np.ndarray]
    alpha: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def order(self) -> int:
        return len(self.counts) - 1

    def losses(self, tokens: np.ndarray) -> np.ndarray:
        """Per-target loss in nats, float64 [L-1] for targets 1..L-1 of a window (0 at N targets),
        each from the longest N-free context of up to `order` bases inside the window."""
        x = np.asarray(tokens)
        valid = x < N_BASES
        avail = _context_lengths(valid, self.order)
        base = np.where(valid, x, 0).astype(np.int64)
        top = _top_code(base, self.order)
        out = np.zeros(len(x))
        for k, table in enumerate(self.counts):
            sel = valid & (avail == k)
            ctx = top[sel] % (N_BASES**k)
            hit = table[ctx, base[sel]].astype(np.float64)
            total = table[ctx].sum(axis=1, dtype=np.float64)
            out[sel] = -np.log((hit + self.alpha) / (total + N_BASES * self.alpha))
        return out[1:]


def _context_lengths(valid: np.ndarray, cap: int) -> np.ndarray:
    """avail[i] = number of valid entries immediately before i (0 at i = 0), capped at `cap`."""
    n = len(valid)
    idx = np.arange(n)
    last_invalid = np.maximum.accumulate(np.where(valid, -1, idx))
    avail = np.zeros(n, dtype=np.int64)
    avail[1:] = idx[:-1] - last_invalid[:-1]
    return np.minimum(avail, cap)


def _context_codes(base: np.ndarray, max_order: int) -> Iterator[tuple[int, np.ndarray]]:
    """(k, code) for k = 0..max_order; code[i] encodes base[i-k..i-1] (oldest digit most
    significant), valid where i >= k. The same array is updated in place between yields."""
    code = np.zeros(len(base), dtype=np.int64)
    yield 0, code
    for k in range(1, max_order + 1):
        code[k:] += base[:-k] * (N_BASES ** (k - 1))
        yield k, code


def _top_code(base: np.ndarray, order: int) -> np.ndarray:
    """code[i] of the `order` bases before i; its k-base suffix code is code % 4**k."""
    for _, code in _context_codes(base, order):
        pass
    return code


def _blocks(seq: np.ndarray, look_back: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """(first, piece): pieces of `seq` with `look_back` bases before their own targets, which
    start at index `first` of the piece; targets from index `start` of `seq` on."""
    n = len(seq)
    for s in range(start, n, _BLOCK):
        lo = max(0, s - look_back)
        yield s - lo, np.asarray(seq[lo : min(n, s + _BLOCK)])


def count_contexts(sequences: Iterable[np.ndarray], max_order: int, starts: Iterable[int] | None = None) -> list[np.ndarray]:
    """counts[k][context, base] over `sequences` (uint8 DNA ids) for k = 0..max_order; a target
    counts at order k only if it and the k bases before it in the same sequence are A/C/G/T.
    `starts` (one per sequence): the targets begin there, the bases before are context only.

    One pass at the top order K: targets with K valid bases before them go into counts[K]; a target with exactly k < K valid bases before it (after an N or near a
    record start; few) is added to counts[k] directly. Then counts[k] += counts[k+1] summed over
    the oldest base, from K-1 down: every target counted at order k+1 is, by its k-base suffix,
    one of order k. Exact, and one data pass instead of K + 1.
    """
    counts = [np.zeros((N_BASES**k, N_BASES), dtype=np.int64) for k in range(max_order + 1)]
    sequences = list(sequences)
    for seq, start in zip(sequences, [0] * len(sequences) if starts is None else starts):
        for first, x in _blocks(seq, max_order, start):
            valid = x < N_BASES
            avail = _context_lengths(valid, max_order)
            target = valid.copy()
            target[:first] = False
            base = np.where(valid, x, 0).astype(np.int64)
            code = _top_code(base, max_order) * N_BASES + base  # (context, base) cell at the top order
            # np.add.at into the kept tables, not a bincount per block: a fresh 512 MiB bincount
            # result per block costs more in page faults than the counting itself.
            np.add.at(counts[max_order].reshape(-1), code[target & (avail == max_order)], 1)
            short = np.flatnonzero(target & (avail < max_order))
            for k in np.unique(avail[short]):
                at = short[avail[short] == k]
                np.add.at(counts[k].reshape(-1), code[at] % (N_BASES ** (k + 1)), 1)
    for k in range(max_order - 1, -1, -1):
        counts[k] += counts[k + 1].reshape(N_BASES, N_BASES**k, N_BASES).sum(axis=0)
    return counts


def validation_bits(
    counts: list[np.ndarray], sequences: Iterable[np.ndarray], alphas: tuple[float, ...]
) -> tuple[np.ndarray, int]:
    """Mean bits/base [order, alpha] on the targets of `sequences` that have len(counts) - 1 valid
    bases before them (the same targets for every order), and the number of those targets."""
    top = len(counts) - 1
    totals = [c.sum(axis=1) for c in counts]
    sums = np.zeros((top + 1, len(alphas)))
    n = 0
    for seq in sequences:
        for first, x in _blocks(seq, top):
            valid = x < N_BASES
            sel = valid & (_context_lengths(valid, top) >= top)
            sel[:first] = False
            if not sel.any():
                continue
            base = np.where(valid, x, 0).astype(np.int64)
            target = base[sel]
            top_ctx = _top_code(base, top)[sel]
            n += len(target)
            for k in range(top + 1):
                ctx = top_ctx % (N_BASES**k)
                cell = ctx * N_BASES + target
                flat = counts[k].reshape(-1)
                # log(count + alpha) over the table and a gather when the table is smaller than
                # the targets (low orders), else over the gathered counts: fewer logs either way.
                small = flat.size <= len(cell)
                for j, a in enumerate(alphas):
                    if small:
                        log_hit = np.log(flat + a)[cell]
                        log_total = np.log(totals[k] + N_BASES * a)[ctx]
                    else:
                        log_hit = np.log(flat[cell] + a)
                        log_total = np.log(totals[k][ctx] + N_BASES * a)
                    sums[k, j] += (log_total.sum() - log_hit.sum()) / LN2
    return (sums / n if n else np.full_like(sums, np.nan)), n


def spread_sample(sequences: list[np.ndarray], max_bases: int, piece: int = 1 << 20) -> list[np.ndarray]:
    """At most about `max_bases` of `sequences`, as evenly spaced pieces: enough to rank orders
    (millions of targets) without scoring a whole chromosome once per order and alpha."""
    total = sum(len(s) for s in sequences)
    if total <= max_bases:
        return list(sequences)
    stride = math.ceil(total / max_bases)  # keep one piece in `stride`
    out, k = [], 0
    for seq in sequences:
        for s in range(0, len(seq), piece):
            if k % stride == 0:
                out.append(seq[s : s + piece])
            k += 1
    return out


def order_cap(max_order: int, train_bases: int) -> int:
    """The highest order worth counting: at most `max_order`, a table within MAX_TABLE_BYTES,
    and no more contexts than train bases."""
    k = max(0, max_order)
    while k > 0 and (N_BASES ** (k + 1) * 8 > MAX_TABLE_BYTES or N_BASES**k > max(train_bases, 1)):
        k -= 1
    return k


def fit(
    train: list[np.ndarray],
    validation: list[np.ndarray],
    *,
    max_order: int = DEFAULT_MAX_ORDER,
    alphas: tuple[float, ...] = DEFAULT_ALPHAS,
    add_back: list[tuple[np.ndarray, int]] | None = None,
) -> MarkovModel:
    """Count orders 0..K on `train`, choose (order, alpha) by bits/base on `validation`, and keep
    the chosen order's tables (plus the counts of `add_back`, the validation slice of the train
    records when there is no validation split: (bases, start) pairs whose targets begin at `start`,
    the bases before it the end of the record's train part, so the slice's first targets keep
    their context as if the record had never been cut)."""
    if not alphas or min(alphas) <= 0:
        raise GenolongError(f"Markov smoothing constants must be positive, got {alphas}")
    train_bases = int(sum(int(np.count_nonzero(np.asarray(s) < N_BASES)) for s in train))
    if train_bases == 0:
        raise GenolongError("the train split has no A/C/G/T base to fit the Markov baseline on; check the prepared data")
    top = order_cap(max_order, train_bases)
    counts = count_contexts(train, top)
    table, n_val = validation_bits(counts, spread_sample(validation, VALIDATION_MAX_BASES), tuple(alphas))
    if n_val == 0:
        raise GenolongError(
            f"the Markov baseline's validation set has no target with {top} N-free bases before it: "
            "give genolong prepare a longer --validation record, or lower --markov-max-order"
        )
    k, j = np.unravel_index(np.nanargmin(table), table.shape)
    kept = counts[: k + 1]
    if add_back:
        extra = count_contexts([seq for seq, _ in add_back], int(k), [start for _, start in add_back])
        kept = [a + b for a, b in zip(kept, extra)]
    counted = int(kept[0].sum())  # order 0 counts every A/C/G/T target once
    info = {
        "order": int(k),
        "alpha": float(alphas[j]),
        "max_order": top,
        "alphas": [float(a) for a in alphas],
        "validation_bits": [[_round(v) for v in row] for row in table],
        "validation": f"{n_val:,} validation targets",
        "validation_targets": n_val,
        "train_bases": counted,
    }
    return MarkovModel(kept, float(alphas[j]), info)


def _round(v: float) -> float | None:
    return None if math.isnan(v) else round(float(v), 6)


def fit_or_load(
    pg,
    cache_dir: Path,
    *,
    max_order: int = DEFAULT_MAX_ORDER,
    alphas: tuple[float, ...] = DEFAULT_ALPHAS,
    echo: Callable[[str], None] = print,
) -> MarkovModel:
    """The Markov baseline of a prepared genome: from `cache_dir/markov.npz` if it was fitted on
    the same data with the same settings, else fitted now (and cached)."""
    train_records = pg.records("train") if "train" in pg.splits else []
    if not train_records:
        raise GenolongError(f"--data {pg.path} has no train split to fit the Markov baseline on; re-run genolong prepare with --train")
    has_validation = "validation" in pg.splits and bool(pg.records("validation"))
    identity = {
        "format": _FORMAT,
        "sha256": pg.manifest.get("source", {}).get("sha256"),
        "train": [list(r) for r in train_records],
        "validation": [list(r) for r in pg.records("validation")] if has_validation else f"last {VALIDATION_FRACTION:.0%} of train",
        "max_order": max_order,
        "alphas": [float(a) for a in alphas],
    }
    path = Path(cache_dir) / CACHE_NAME
    cached = _load(path, identity)
    if cached is not None:
        return cached

    def read(split: str, name: str, start: int, stop: int) -> np.ndarray:
        return pg.read(split, name, start, stop - start)[0]

    if has_validation:
        train = [read("train", n, 0, length) for n, length in train_records]
        validation = [read("validation", n, 0, length) for n, length in pg.records("validation")]
        add_back = None
        where = f"the validation split ({', '.join(n for n, _ in pg.records('validation'))})"
    else:
        cuts = [(n, length, length - int(length * VALIDATION_FRACTION)) for n, length in train_records]
        train = [read("train", n, 0, cut) for n, _, cut in cuts]
        validation = [read("train", n, cut, length) for n, length, cut in cuts if cut < length]
        # The counted slices carry the bases before the cut as context (up to the highest order).
        reach = order_cap(max_order, sum(length for _, length in train_records))
        add_back = [(read("train", n, max(0, cut - reach), length), cut - max(0, cut - reach))
                    for n, length, cut in cuts if cut < length]
        where = f"the last {VALIDATION_FRACTION:.0%} of each train record (the data has no validation split)"
    bases = sum(length for _, length in train_records)
    echo(f"fitting the Markov baseline (orders 0-{order_cap(max_order, bases)}) on {bases:,} train bases ...")
    t0, c0 = time.perf_counter(), time.process_time()
    model = fit(train, validation, max_order=max_order, alphas=alphas, add_back=add_back)
    model.info.update(
        validation=where,
        fit_seconds=round(time.perf_counter() - t0, 2),
        fit_cpu_seconds=round(time.process_time() - c0, 2),
    )
    best = model.info["validation_bits"][model.order][model.info["alphas"].index(model.alpha)]
    echo(
        f"Markov baseline: order {model.order}, add-{model.alpha:g} smoothing, {best:.4f} bits/base on {where} "
        f"({model.info['fit_seconds']:.1f} s)"
    )
    _save(path, identity, model)
    return model


def _save(path: Path, identity: dict, model: MarkovModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    # Counts fit in uint32 for any genome under 4.29 Gb: half the file.
    arrays = {f"counts_{k}": c.astype(np.uint32) for k, c in enumerate(model.counts)}
    header = json.dumps({"identity": identity, "alpha": model.alpha, "info": model.info})
    with open(tmp, "wb") as f:
        np.savez(f, header=np.array(header), **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path, identity: dict) -> MarkovModel | None:
    """The cached model, or None when there is none, it is unreadable or it was fitted otherwise."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            if header["identity"] != json.loads(json.dumps(identity)):
                return None
            counts = [z[f"counts_{k}"].astype(np.int64) for k in range(header["info"]["order"] + 1)]
    except (OSError, ValueError, KeyError):
        return None
    return MarkovModel(counts, float(header["alpha"]), header["info"])
