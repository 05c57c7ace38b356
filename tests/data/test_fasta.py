"""The FASTA reader and encoder on their own: byte tables, block boundaries, sniffing."""

import gzip

import numpy as np
import pytest

from genolong.data import bundled_genome_path
from genolong.data.encode import RecordStats, count_bases, encode, split_codes
from genolong.data.fasta import HEADER, events, open_stream, parse_header, records, sniff
from genolong.errors import GenolongError

from .conftest import REFERENCE_IDS


def test_every_byte_is_encoded_or_rejected_as_documented():
    allowed = set("ACGTNRYSWKMBDHVU" + "ACGTNRYSWKMBDHVU".lower())
    blanks = set("\r\n\t \x0b\x0c")
    for byte in range(256):
        char = chr(byte)
        stats = RecordStats()
        chunk = b"AC" + bytes([byte]) + b"gt"
        if char in blanks:
            tokens, mask = split_codes([encode(chunk, stats, "r")], stats)
            assert tokens.tolist() == [0, 1, 2, 3] and mask.tolist() == [0, 0, 1, 1]
        elif char in allowed:
            tokens, mask = split_codes([encode(chunk, stats, "r")], stats)
            assert tokens.tolist() == [0, 1, REFERENCE_IDS.get(char.upper(), 4), 2, 3]
            assert mask.tolist() == [0, 0, int(char.islower()), 1, 1]
            assert stats.n_count == int(char.upper() not in "ACGT")
            assert stats.iupac_to_n == int(char.upper() not in "ACGTN")
        else:
            with pytest.raises(GenolongError, match="at base 3"):
                encode(chunk, stats, "r")


def test_count_bases_ignores_line_breaks_and_blanks():
    assert count_bases(b"ACGT\r\nAC GT\tA\n") == 9


def test_parse_header():
    assert parse_header(b"chr1  AC:CM000663.2 gi|568336023\r") == ("chr1", "AC:CM000663.2 gi|568336023")
    assert parse_header(b"chr2\tdescr") == ("chr2", "descr")


@pytest.mark.parametrize("block", [1, 2, 3, 5, 64, 1 << 20])
def test_events_are_independent_of_block_size(tmp_path, block):
    text = b">a one\nACGT\nAC\n>b\r\nGG\r\nTT\r\n>c\n>d x\nNNNN"
    path = tmp_path / "x.fa"
    path.write_bytes(text)
    source = sniff(path)
    with open_stream(source) as stream:
        got = [(h.decode(), b"".join(chunks).decode()) for h, chunks in records(stream, source)]
    assert got == [("a one", "ACGT\nAC\n"), ("b\r", "GG\r\nTT\r\n"), ("c", ""), ("d x", "NNNN")]
    with open_stream(source) as stream:
        headers = [d for kind, d in events(stream, source, block=block) if kind == HEADER]
    assert headers == [b"a one", b"b\r", b"c", b"d x"]


def test_sniff_tells_compressions_apart(tmp_path):
    plain = tmp_path / "p.fa"
    plain.write_bytes(b">x\nACGT\n")
    gz = tmp_path / "p.fa.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert sniff(plain).compression == "plain"
    assert sniff(gz).compression == "gzip"
    assert sniff(bundled_genome_path()).compression == "bgzip"


def test_split_codes_frees_chunks_and_counts(tmp_path):
    stats = RecordStats()
    codes = [encode(b"ACgtN\n", stats, "r"), encode(b"nnRy\n", stats, "r")]
    tokens, mask = split_codes(codes, stats)
    assert codes == []
    assert tokens.tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 4]
    assert mask.astype(bool).tolist() == [False, False, True, True, False, True, True, False, True]
    assert (stats.length, stats.n_count, stats.repeat_count, dict(stats.iupac)) == (9, 5, 5, {"R": 1, "Y": 1})
    assert isinstance(tokens, np.ndarray)
