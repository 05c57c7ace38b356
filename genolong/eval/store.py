"""Resumable per-window results: one JSON line per (model, window), appended as soon as it is scored.

A 512k evaluation of two models over chr22 runs for a long time; an interruption must cost at
most the window in flight. The partial file starts with a header holding the settings that
change the numbers (window, bucket, control, models, data); a rerun with the same settings
skips the windows already in the file, a rerun with different settings is refused (mixing them
would silently corrupt the curves). A line cut off by the interruption is ignored. Final
outputs are written through `write_atomic`, so a reader never sees half a table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from genolong.errors import GenolongError
from genolong.eval.positional import WindowScore

WindowKey = tuple[str, int, bool]  # (record, start, reverse)

PARTIAL_NAME = "partial.jsonl"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary sibling, fsync, then rename over `path` (rename is atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _first_difference(old: Any, new: Any, prefix: str = "") -> str | None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            diff = _first_difference(old.get(key), new.get(key), f"{prefix}{key}.")
            if diff:
                return diff
        return None
    return None if old == new else f"{prefix.rstrip('.')}: {old!r} before, {new!r} now"


class PartialResults:
    """The partial file of one output directory."""

    def __init__(self, out_dir: Path, fingerprint: dict[str, Any], *, overwrite: bool = False) -> None:
        self.path = Path(out_dir) / PARTIAL_NAME
        # A JSON round trip so that tuples vs lists cannot make equal settings look different.
        self.fingerprint = json.loads(json.dumps(fingerprint))
        self._done: dict[str, dict[WindowKey, WindowScore]] = {}
        self.seconds: dict[str, dict[WindowKey, float]] = {}  # scoring wall time, for the cost report
        if self.path.exists() and overwrite:
            self.path.unlink()
        if self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"kind": "header", "fingerprint": self.fingerprint}) + "\n")

    def _load(self) -> None:
        with open(self.path) as f:
            lines = f.read().split("\n")
        try:
            header = json.loads(lines[0])
            assert header.get("kind") == "header"
        except (ValueError, AssertionError):
            raise GenolongError(
                f"{self.path} is not a genolong partial-results file: remove it or pass --overwrite"
            ) from None
        diff = _first_difference(header["fingerprint"], self.fingerprint)
        if diff:
            raise GenolongError(
                f"{self.path.parent} holds partial results of a different evaluation ({diff}): "
                "pass another --out, or --overwrite to start again"
            )
        good = 1
        for i, line in enumerate(lines[1:], start=1):
            if not line:
                continue
            try:
                row = json.loads(line)
                key = (row["record"], int(row["start"]), bool(row["reverse"]))
                score = WindowScore(
                    sums=np.array(row["sums"], dtype=np.float64), counts=np.array(row["counts"], dtype=np.int64)
                )
            except (ValueError, KeyError, TypeError):
                break  # the interrupted write: everything after it is discarded
            self._done.setdefault(row["model"], {})[key] = score
            if row.get("seconds") is not None:
                self.seconds.setdefault(row["model"], {})[key] = float(row["seconds"])
            good = i + 1
        if good < len([ln for ln in lines if ln]):
            # Drop the torn tail so that new lines are not appended after garbage.
            write_atomic(self.path, "\n".join(lines[:good]) + "\n")

    def done(self, model: str, key: WindowKey) -> bool:
        return key in self._done.get(model, {})

    def get(self, model: str, key: WindowKey) -> WindowScore:
        return self._done[model][key]

    def append(self, model: str, key: WindowKey, score: WindowScore, seconds: float | None = None) -> None:
        sums = [[[None if np.isnan(v) else float(v) for v in row] for row in mode] for mode in score.sums]
        line = json.dumps(
            {
                "kind": "window",
                "model": model,
                "record": key[0],
                "start": int(key[1]),
                "reverse": bool(key[2]),
                "sums": sums,
                "counts": score.counts.tolist(),
                "seconds": seconds,
            }
        )
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._done.setdefault(model, {})[key] = score
        if seconds is not None:
            self.seconds.setdefault(model, {})[key] = seconds
