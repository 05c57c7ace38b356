"""Reading FASTA: sniff the file, then stream its records as (header, sequence-chunk) events.

Plain, gzip and bgzip files all stream through one parser over big blocks (16 MiB), so no
whole record, let alone a genome, is ever one Python object. When a samtools index is present
and fresh (`.fai`, plus `.gzi` for bgzip), pyfaidx reads it: record names and lengths are
known before any sequence is read, and only the requested records' bytes are read.
"""

import bisect
import gzip
import os
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from genolong.errors import GenolongError

BLOCK = 16 << 20
HEADER, SEQUENCE = "header", "sequence"
# An index this much older than its FASTA is stale; a smaller gap is checkout/copy noise.
_STALE_SLACK_S = 2.0

_OTHER_COMPRESSION = {
    b"BZh": "bzip2",
    b"\xfd7zXZ": "xz",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"PK\x03\x04": "zip",
}


@dataclass(frozen=True)
class FastaSource:
    path: Path
    compression: str  # "plain", "gzip" or "bgzip"
    size: int


def sniff(path: str | os.PathLike) -> FastaSource:
    """Checks that `path` is a readable, non-empty FASTA file (after decompression)."""
    p = Path(path)
    if not p.exists():
        raise GenolongError(f"FASTA file {str(p)!r} does not exist: check the --fasta path")
    if not p.is_file():
        raise GenolongError(f"{str(p)!r} is not a file: give --fasta the path of a FASTA file")
    size = p.stat().st_size
    if size == 0:
        raise GenolongError(f"FASTA file {str(p)!r} is empty: download or copy it again")
    try:
        with open(p, "rb") as f:
            magic = f.read(18)
    except OSError as err:
        raise GenolongError(f"cannot read FASTA file {str(p)!r} ({err.strerror}): check its permissions") from None
    for prefix, kind in _OTHER_COMPRESSION.items():
        if magic.startswith(prefix):
            raise GenolongError(
                f"{str(p)!r} is {kind}-compressed, which genolong does not read: "
                "decompress it, or recompress it with bgzip"
            )
    compression = "plain"
    if magic[:2] == b"\x1f\x8b":
        # BGZF: gzip member with the FEXTRA flag and a 'BC' subfield (SAM spec, section 4.1).
        compression = "bgzip" if len(magic) >= 14 and magic[3] & 4 and magic[12:14] == b"BC" else "gzip"
    source = FastaSource(p, compression, size)
    _check_head(source)
    return source


def _check_head(source: FastaSource) -> None:
    with open_stream(source) as stream:
        head = read_checked(stream, 1 << 16, source)
    name = str(source.path)
    if not head.strip():
        raise GenolongError(f"FASTA file {name!r} is empty (no records): download or copy it again")
    if b"\x00" in head:
        raise GenolongError(f"{name!r} is a binary file, not FASTA: give --fasta a FASTA file (.fa, .fa.gz)")
    first = head.lstrip()[:1]
    if first == b">":
        return
    if head.startswith(b"\xef\xbb\xbf"):
        raise GenolongError(
            f"{name!r} starts with a UTF-8 byte-order mark (as some Windows editors save text) before its first '>': "
            "save it without one, e.g. `sed -i '1s/^\\xEF\\xBB\\xBF//' FILE`"
        )
    if first == b"@":
        raise GenolongError(
            f"{name!r} looks like FASTQ (reads), not FASTA: "
            "give --fasta a genome FASTA (convert reads with `seqtk seq -a`)"
        )
    if first == b"<":
        raise GenolongError(
            f"{name!r} looks like HTML/XML, not FASTA (a failed download?): download the FASTA file again"
        )
    raise GenolongError(f"{name!r} is not FASTA (it does not start with '>'): give --fasta a FASTA file")


class _CountingReader:
    """Raw file wrapper that counts bytes read, so progress can follow compressed input."""

    def __init__(self, f):
        self._f = f
        self.bytes_read = 0

    def read(self, n=-1):
        data = self._f.read(n)
        self.bytes_read += len(data)
        return data

    def readable(self):
        return True

    def close(self):
        self._f.close()


class _Stream:
    def __init__(self, source: FastaSource, raw_offset: int = 0):
        f = open(source.path, "rb")
        f.seek(raw_offset)
        self.raw = _CountingReader(f)
        self.reader = self.raw if source.compression == "plain" else gzip.GzipFile(fileobj=self.raw, mode="rb")

    def read(self, n: int) -> bytes:
        return self.reader.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.reader is not self.raw:
            self.reader.close()
        self.raw.close()


def open_stream(source: FastaSource, raw_offset: int = 0) -> _Stream:
    """Decompressed bytes of `source` (bgzip is multi-member gzip), from a member start if given."""
    return _Stream(source, raw_offset)


def read_checked(stream: _Stream, n: int, source: FastaSource) -> bytes:
    """`stream.read(n)`, with truncated or corrupt gzip turned into a one-line error."""
    try:
        return stream.read(n)
    except EOFError:
        raise GenolongError(
            f"{str(source.path)!r} is a truncated gzip file (it ends mid-stream): "
            "download it again (check with `gzip -t`)"
        ) from None
    except (gzip.BadGzipFile, zlib.error, OSError) as err:
        if source.compression == "plain":
            raise GenolongError(f"reading {str(source.path)!r} failed ({err}): check the file and the disk") from None
        raise GenolongError(
            f"{str(source.path)!r} is a corrupt gzip file ({err}): download it again (check with `gzip -t`)"
        ) from None


def parse_header(line: bytes) -> tuple[str, str]:
    """`>chr1 description` -> ('chr1', 'description'): the name is the first word, as samtools does."""
    text = line.rstrip(b"\r").decode("utf-8", errors="replace")
    name, _, description = text.strip().partition(" ")
    if "\t" in name:
        name, _, rest = name.partition("\t")
        description = (rest + " " + description).strip()
    return name, description.strip()


def events(stream: _Stream, source: FastaSource, block: int | None = None) -> Iterator[tuple[str, bytes]]:
    """(HEADER, header line without '>') and (SEQUENCE, raw bytes incl. line breaks), in file order.

    A '>' counts as a header only at the start of a line; one inside a line stays in the sequence
    bytes, where the encoder rejects it as a non-base character.
    """
    block = block or BLOCK
    at_line_start = True
    carry = b""
    while True:
        chunk = read_checked(stream, block, source)
        if not chunk:
            break
        data = carry + chunk if carry else chunk
        carry = b""
        pos, n = 0, len(data)
        while pos < n:
            j = data.find(b">", pos)
            while j != -1 and not ((j == 0 and at_line_start) or (j > 0 and data[j - 1] == 10)):
                j = data.find(b">", j + 1)
            if j == -1:
                yield SEQUENCE, (data if pos == 0 else data[pos:])
                break
            if j > pos:
                yield SEQUENCE, data[pos:j]
            k = data.find(b"\n", j)
            if k == -1:
                carry = data[j:]
                break
            yield HEADER, data[j + 1 : k]
            pos = k + 1
        at_line_start = bool(carry) or data.endswith(b"\n")
    if carry:
        yield HEADER, carry[1:]


@dataclass(frozen=True)
class IndexedRecord:
    name: str
    length: int
    offset: int  # uncompressed byte offset of the first base
    end: int  # uncompressed byte offset just past the last base
    header_start: int  # where the previous record's bases end: the '>' line lies between


class FastaIndex:
    """A fresh samtools index read through pyfaidx, or None from `load` when there is none."""

    def __init__(self, source: FastaSource, records: list[IndexedRecord], gzi_blocks: list | None):
        self.source = source
        self.records = records
        self._gzi = gzi_blocks

    @staticmethod
    def load(source: FastaSource) -> "FastaIndex | None":
        if source.compression == "gzip":
            return None
        if (source.compression == "bgzip") != source.path.name.lower().endswith((".gz", ".bgz")):
            return None  # pyfaidx decides bgzip by the file name; a misnamed file is streamed instead
        fai = Path(str(source.path) + ".fai")
        needed = [fai] + ([Path(str(source.path) + ".gzi")] if source.compression == "bgzip" else [])
        mtime = source.path.stat().st_mtime
        if not all(p.is_file() and p.stat().st_mtime + _STALE_SLACK_S >= mtime for p in needed):
            return None
        import pyfaidx

        try:
            with warnings.catch_warnings():
                # Within the slack above pyfaidx may still call the index "older"; that is not news to the user.
                warnings.simplefilter("ignore")
                faidx = pyfaidx.Faidx(str(source.path), build_index=False, rebuild=False)
        except Exception:
            # An unreadable index is only a lost shortcut: streaming reads the FASTA itself.
            return None
        try:
            records = [IndexedRecord(name, r.rlen, r.offset, r.bend, r.prev_bend) for name, r in faidx.index.items()]
            gzi = list(faidx.gzi_index) if source.compression == "bgzip" else None
        finally:
            faidx.close()
        return FastaIndex(source, records, gzi)

    def description(self, record: IndexedRecord) -> str:
        """The description on the record's '>' line (the index keeps only the name)."""
        text = b"".join(self._range(record.header_start, record.offset, record.name))
        # The '>' line is the last line of the range; for the first record rfind gives -1 and -1 + 2
        # lands just past its '>' too.
        return parse_header(text[text.rfind(b"\n>", 0, len(text) - 1) + 2 :].rstrip(b"\r\n"))[1]

    def chunks(self, record: IndexedRecord, block: int | None = None) -> Iterator[bytes]:
        """The raw bytes (with line breaks) of one record, read from its offset."""
        return self._range(record.offset, record.end, record.name, block)

    def unlisted_record(self) -> str | None:
        """Where the file holds a '>' record the index does not list (samtools keeps only the first of
        two records with one name), as "before <name>" / "after <name>"; None when it lists them all.
        Only the bytes between indexed records are read: a header line each, normally."""
        ordered = sorted(self.records, key=lambda r: r.offset)
        for rec in ordered:
            headers, last = 0, b"\n"
            for data in self._range(rec.header_start, rec.offset, rec.name, 1 << 16, must_end=False):
                headers += (last + data).count(b"\n>")
                last = data[-1:]
                if headers > 1:
                    return f"before {rec.name!r}"
        if ordered:
            after = ordered[-1]
            for data in self._range(after.end, after.end + (1 << 16), after.name, must_end=False):
                if b">" in data:
                    return f"after {after.name!r}"
        return None

    def _range(self, begin: int, end: int, name: str, block: int | None = None, must_end: bool = True) -> Iterator[bytes]:
        block = block or BLOCK
        raw_offset, skip = begin, 0
        if self._gzi is not None:
            # Seek to the BGZF block holding the range's first byte, then skip into that block.
            i = max(bisect.bisect_right([b.ustart for b in self._gzi], begin) - 1, 0)
            raw_offset, skip = self._gzi[i].cstart, begin - self._gzi[i].ustart
        with open_stream(self.source, raw_offset) as stream:
            remaining = skip + end - begin
            while remaining > 0:
                data = read_checked(stream, min(remaining, block), self.source)
                if not data and not must_end:
                    return
                if not data:
                    raise GenolongError(
                        f"{str(self.source.path)!r} ends inside record {name!r} that its .fai index describes: "
                        f"the file is truncated or the index is stale; download the file again or delete its .fai"
                    )
                remaining -= len(data)
                if skip >= len(data):
                    skip -= len(data)
                    continue
                yield data[skip:] if skip else data
                skip = 0


def records(stream: _Stream, source: FastaSource) -> Iterator[tuple[bytes, Iterator[bytes]]]:
    """(header line, its sequence chunks) per record; a record's chunks are drained before the next."""
    it = events(stream, source)
    next_header: list[bytes | None] = [None]

    def chunks() -> Iterator[bytes]:
        for kind, data in it:
            if kind == HEADER:
                next_header[0] = data
                return
            yield data

    for kind, data in it:
        if kind == HEADER:
            next_header[0] = data
            break
        if data.strip():
            raise GenolongError(f"{str(source.path)!r} has sequence before its first '>' line: it is not FASTA")
    while next_header[0] is not None:
        header, next_header[0] = next_header[0], None
        body = chunks()
        yield header, body
        for _ in body:
            pass
