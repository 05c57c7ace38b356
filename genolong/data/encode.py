"""FASTA sequence bytes -> token ids and repeat mask, vectorised with `bytes.translate`.

One translate pass maps every byte through a 256-entry table in C (~0.7 GB/s here) and drops
line breaks in the same pass, so no per-base Python runs. Bytes that are not bases map to 0xFF,
which one `find` (memchr speed) then reports with its position.
"""

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from genolong.errors import GenolongError
from genolong.vocab import DNA_VOCAB, N_ID

# Line breaks and stray blanks (trailing spaces are common in hand-edited files) are not bases.
WHITESPACE = b"\r\n\t \x0b\x0c"
# IUPAC ambiguity codes (and U, uracil) have no token of their own: they become N and are counted.
IUPAC_TO_N = "RYSWKMBDHVU"
INVALID = 0xFF

# One table gives a combined code per base: token id in bits 0-2, IUPAC-made-N in bit 3,
# lowercase (repeat) in bit 7. Numpy then splits codes at ~10 GB/s: tokens = code & 7,
# mask = code >> 7. (0xFF cannot be a real code: token ids stop at 4.)
IUPAC_BIT, LOWER_BIT = 8, 128
_CODE = bytearray([INVALID] * 256)
for _base, _id in [*DNA_VOCAB.items(), *((c, N_ID | IUPAC_BIT) for c in IUPAC_TO_N)]:
    _CODE[ord(_base)] = _id
    _CODE[ord(_base.lower())] = _id | LOWER_BIT
CODE_TABLE = bytes(_CODE)
_PLAIN = b"ACGTNacgtn" + WHITESPACE
_ALLOWED = _PLAIN + IUPAC_TO_N.encode() + IUPAC_TO_N.lower().encode()


class InvalidBases(GenolongError):
    pass


@dataclass
class RecordStats:
    """Running counts for one record while its chunks stream through `encode`."""

    length: int = 0
    n_count: int = 0
    repeat_count: int = 0
    iupac: Counter = field(default_factory=Counter)

    @property
    def iupac_to_n(self) -> int:
        return sum(self.iupac.values())


def encode(chunk: bytes, stats: RecordStats, record: str) -> bytes:
    """Combined codes (see CODE_TABLE) of `chunk`'s bases; updates length and IUPAC counts.

    Raises InvalidBases, naming the characters and the base position, for anything not a base.
    """
    code = chunk.translate(CODE_TABLE, WHITESPACE)
    bad = code.find(INVALID)
    if bad != -1:
        chars = sorted(set(chunk.translate(None, _ALLOWED).decode("latin-1")))
        shown = ", ".join(repr(c) for c in chars[:8])
        raise InvalidBases(
            f"record {record!r} has characters that are not bases ({shown}) at base {stats.length + bad + 1:,}: "
            f"fix or remove that sequence line (allowed: ACGTN, IUPAC codes {IUPAC_TO_N}, lowercase for repeats)"
        )
    if np.bitwise_and(np.frombuffer(code, dtype=np.uint8), IUPAC_BIT).any():
        # Rare: name the codes. Deleting the plain bases leaves exactly the IUPAC ones.
        stats.iupac.update(chunk.translate(None, _PLAIN).upper().decode("ascii"))
    stats.length += len(code)
    return code


def split_codes(codes: list[bytes], stats: RecordStats) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and repeat mask (0/1) of a record from its code chunks, which are consumed.

    The record's arrays are allocated once at their final size (growing a buffer chunk by chunk
    would copy it over and over); each chunk is freed as soon as it is split, so memory peaks
    near 3 bytes per base.
    """
    total = sum(len(c) for c in codes)
    tokens = np.empty(total, dtype=np.uint8)
    mask = np.empty(total, dtype=np.uint8)
    at = 0
    codes.reverse()
    while codes:
        code = np.frombuffer(codes.pop(), dtype=np.uint8)
        t, m = tokens[at : at + code.size], mask[at : at + code.size]
        np.bitwise_and(code, 7, out=t)
        np.right_shift(code, 7, out=m)
        stats.n_count += int(np.count_nonzero(t == N_ID))
        stats.repeat_count += int(np.count_nonzero(m))
        at += code.size
    return tokens, mask


def count_bases(chunk: bytes) -> int:
    """Length of a chunk of a record that is left out: counted, not checked or stored."""
    n = len(chunk) - chunk.count(b"\n")
    for blank in b"\r\t \x0b\x0c":
        # `in` is a memchr scan, far cheaper than counting a byte that is usually absent.
        if blank in chunk:
            n -= chunk.count(blank)
    return n
