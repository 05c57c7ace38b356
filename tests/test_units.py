import pytest

from genolong.errors import GenolongError
from genolong.units import format_length, parse_length


@pytest.mark.parametrize(
    "text,expected", [("512k", 512 * 1024), ("1M", 1 << 20), ("32K", 32768), ("2048", 2048), (77, 77), (" 4k ", 4096)]
)
def test_parse_length(text, expected):
    assert parse_length(text) == expected


@pytest.mark.parametrize("text", ["", "k", "1.5M", "-3", "0", "12q", "abc"])
def test_parse_length_rejects(text):
    with pytest.raises(GenolongError):
        parse_length(text)


@pytest.mark.parametrize("n", [1, 1000, 1024, 524288, 1 << 20, 3 << 20, 1536])
def test_format_roundtrip(n):
    assert parse_length(format_length(n)) == n
