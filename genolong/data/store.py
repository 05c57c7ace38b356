"""The on-disk layout: a `datasets` DatasetDict directory of Arrow IPC stream files.

Each record (chromosome) is one row in its own shard file (`data-0000i-of-0000n.arrow`), written
from one contiguous buffer: Arrow cannot split a value across record batches, and one record
per shard lets `prepare` decide a record's split after it is written (name aliasing) by
renaming the file. `tokens` and `repeat_mask` are `large_binary` (int64 offsets: chr1 is 249 MB),
one byte per base, so a window is a slice of the memory-mapped file: reading 512k bases of chr1
touches 512 kB, not the chromosome, and the mask views as numpy bool without a copy.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

FEATURES = {
    "name": "string",
    "description": "string",
    "length": "int64",
    "tokens": "large_binary",
    "repeat_mask": "large_binary",
    "n_count": "int64",
    "repeat_count": "int64",
    "iupac_to_n": "int64",
}
_ARROW_TYPES = {"string": pa.string(), "int64": pa.int64(), "large_binary": pa.large_binary()}
_FEATURES_JSON = {name: {"dtype": dtype, "_type": "Value"} for name, dtype in FEATURES.items()}
SCHEMA = pa.schema(
    [(name, _ARROW_TYPES[dtype]) for name, dtype in FEATURES.items()],
    # `datasets` reads the column types back from this key.
    metadata={"huggingface": json.dumps({"info": {"features": _FEATURES_JSON}})},
)


def _one_value(data) -> pa.Array:
    buf = pa.py_buffer(data)
    offsets = pa.py_buffer(np.array([0, buf.size], dtype=np.int64))
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, buf])


def write_record(
    path: Path, name: str, description: str, tokens, mask, n_count: int, repeat_count: int, iupac_to_n: int
) -> None:
    """One row, written from the caller's buffers without copying them into Python objects."""
    columns = [
        pa.array([name], pa.string()),
        pa.array([description], pa.string()),
        pa.array([len(tokens)], pa.int64()),
        _one_value(tokens),
        _one_value(mask),
        pa.array([n_count], pa.int64()),
        pa.array([repeat_count], pa.int64()),
        pa.array([iupac_to_n], pa.int64()),
    ]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_batch(pa.record_batch(columns, schema=SCHEMA))


def write_split(root: Path, split: str, shards: list[Path], fingerprint: str) -> None:
    """Moves the record shards of one split into `root/split/` with the files `datasets` expects."""
    split_dir = root / split
    split_dir.mkdir()
    files = []
    for i, shard in enumerate(shards):
        filename = f"data-{i:05d}-of-{len(shards):05d}.arrow"
        os.replace(shard, split_dir / filename)
        files.append({"filename": filename})
    state = {
        "_data_files": files,
        "_fingerprint": hashlib.sha256(f"{fingerprint}/{split}".encode()).hexdigest()[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {"citation": "", "description": "", "features": _FEATURES_JSON, "homepage": "", "license": ""}
    (split_dir / "state.json").write_text(json.dumps(state, indent=2))
    (split_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))


def write_dataset_dict(root: Path, splits: list[str]) -> None:
    (root / "dataset_dict.json").write_text(json.dumps({"splits": splits}))


@dataclass(frozen=True)
class StoredRecord:
    """One record's columns, as zero-copy views of the memory-mapped shard."""

    name: str
    length: int
    tokens: pa.Buffer
    repeat_mask: pa.Buffer


def _value_buffer(column: pa.ChunkedArray) -> pa.Buffer:
    array = column.chunk(0)
    _, offsets, data = array.buffers()
    begin, end = np.frombuffer(offsets, dtype=np.int64, count=2, offset=8 * array.offset)
    return data.slice(int(begin), int(end - begin))


def read_split(root: Path, split: str) -> list[StoredRecord]:
    """Memory-maps every shard of a split; raises OSError/ArrowInvalid/KeyError on a damaged one."""
    split_dir = root / split
    state = json.loads((split_dir / "state.json").read_text())
    records = []
    for entry in state["_data_files"]:
        source = pa.memory_map(str(split_dir / entry["filename"]), "r")
        table = pa.ipc.open_stream(source).read_all()
        for column in ("name", "length", "tokens", "repeat_mask"):
            if column not in table.column_names:
                raise KeyError(column)
        if table.num_rows != 1:
            raise ValueError(f"{entry['filename']} has {table.num_rows} rows, expected 1")
        records.append(
            StoredRecord(
                name=table.column("name")[0].as_py(),
                length=table.column("length")[0].as_py(),
                tokens=_value_buffer(table.column("tokens")),
                repeat_mask=_value_buffer(table.column("repeat_mask")),
            )
        )
    return records
