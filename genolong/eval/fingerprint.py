"""A model directory's identity by content: what eval-positional's partial results are keyed on.

Paths and modification times say nothing about the weights: a run directory copied to another
disk (new path, new mtimes) holds the same model, and a checkpoint rewritten in place within the
same second holds another. The fingerprint is a SHA-256 over config.json and every
`*.safetensors` file: each file's name and size, then its whole content when it is small (under
64 MiB: every byte counts, so a one-byte change is seen), else its header (the tensor names,
shapes, dtypes and offsets) and 256 strided 64 KiB samples of its data, the last bytes
included. A sampled file is read at 16 MiB, so a 1.5 TB checkpoint costs seconds, not an hour;
a change confined to bytes between the samples of a big file goes unseen, but training changes
every weight, and a different checkpoint differs at every sample.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

FULL_HASH_BYTES = 64 << 20
SAMPLES = 256
SAMPLE_BYTES = 64 << 10
_READ = 1 << 20


def model_fingerprint(model_dir: Path) -> str:
    """'sha256:<hex>' of the model directory's config.json and safetensors files (see module doc)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(b"genolong-model-fingerprint-1\0")
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    for path in files:
        if not path.is_file():
            continue
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= FULL_HASH_BYTES:
                while chunk := f.read(_READ):
                    h.update(chunk)
            else:
                _sampled(f, size, h)
    return "sha256:" + h.hexdigest()


def _sampled(f, size: int, h) -> None:
    header_end = 0
    head = f.read(8)
    if len(head) == 8:
        # safetensors: an 8-byte little-endian header length, then the JSON header.
        (n,) = struct.unpack("<Q", head)
        if 0 < n <= size - 8:
            header_end = 8 + n
            h.update(head + f.read(n))
    span = size - header_end
    step = max(SAMPLE_BYTES, span // SAMPLES)
    offsets = list(range(header_end, size - SAMPLE_BYTES, step)) + [max(header_end, size - SAMPLE_BYTES)]
    for off in offsets:
        f.seek(off)
        h.update(f.read(SAMPLE_BYTES))
