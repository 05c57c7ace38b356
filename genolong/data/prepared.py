"""Reading a prepared directory: `open_prepared(path)` -> PreparedGenome with zero-copy `read`."""

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from genolong.data import manifest as manifest_io
from genolong.data import store
from genolong.errors import GenolongError
from genolong.invocation import command


class PreparedGenome:
    """A `genolong prepare` output, memory-mapped; `read` returns views, never a whole record."""

    def __init__(self, path: Path, manifest: dict, records: dict[str, list[store.StoredRecord]]):
        self.path = path
        self.manifest = manifest
        self._records = records
        self._by_name = {split: {r.name: r for r in recs} for split, recs in records.items()}

    @property
    def splits(self) -> list[str]:
        return list(self._records)

    def _split(self, split: str) -> list[store.StoredRecord]:
        if split not in self._records:
            raise GenolongError(
                f"split {split!r} is not in {str(self.path)!r} (it has {', '.join(self.splits)}): "
                f"use one of those, or re-run genolong prepare with --{split}"
            )
        return self._records[split]

    def records(self, split: str) -> list[tuple[str, int]]:
        """(name, length) of the split's records, in the order they were asked for."""
        return [(r.name, r.length) for r in self._split(split)]

    def read(self, split: str, record_name: str, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """tokens uint8[length] and repeat_mask bool[length]: read-only views of the mapped file."""
        self._split(split)
        try:
            rec = self._by_name[split][record_name]
        except KeyError:
            raise KeyError(f"record {record_name!r} is not in split {split!r}") from None
        if start < 0 or length < 0 or start + length > rec.length:
            raise IndexError(f"[{start}, {start + length}) is outside record {record_name!r} of length {rec.length}")
        tokens = np.frombuffer(rec.tokens, dtype=np.uint8, count=length, offset=start)
        mask = np.frombuffer(rec.repeat_mask, dtype=np.bool_, count=length, offset=start)
        return tokens, mask

    def __repr__(self) -> str:
        parts = ", ".join(f"{s}: {len(r)} records" for s, r in self._records.items())
        return f"PreparedGenome({str(self.path)!r}; {parts})"


def open_prepared(path: str | os.PathLike) -> PreparedGenome:
    """Opens and checks a prepared directory against its manifest; GenolongError with the fix if bad."""
    root = Path(path)
    manifest = manifest_io.read(root)
    redo = f"re-run `{command()} prepare ... --out {root} --overwrite`"
    try:
        listed = json.loads((root / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError):
        raise GenolongError(f"{str(root)!r} has no readable dataset_dict.json: the output is damaged; {redo}") from None
    if sorted(listed) != sorted(manifest["splits"]):
        raise GenolongError(f"{str(root)!r}: dataset_dict.json and manifest.json disagree on the splits; {redo}")
    expected = {r["name"]: r["length"] for r in manifest["records"]}
    records: dict[str, list[store.StoredRecord]] = {}
    for split, names in manifest["splits"].items():
        try:
            stored = store.read_split(root, split)
        except (OSError, ValueError, KeyError, pa.ArrowException) as err:
            raise GenolongError(f"split {split!r} of {str(root)!r} is damaged or incomplete ({err}); {redo}") from None
        found = [(r.name, r.length, r.tokens.size, r.repeat_mask.size) for r in stored]
        want = [(n, expected.get(n), expected.get(n), expected.get(n)) for n in names]
        if found != want:
            raise GenolongError(f"split {split!r} of {str(root)!r} does not match manifest.json; {redo}")
        records[split] = stored
    return PreparedGenome(root, manifest, records)
