"""Token-count strings used on the command line: `512k`, `1M`, `32k`, `2048`.

k = 1024 and M = 1024 * 1024 (the convention of the long-context literature: 512k = 524,288).
"""

from genolong.errors import GenolongError

_SUFFIX = {"k": 1024, "K": 1024, "m": 1024 * 1024, "M": 1024 * 1024}


def parse_length(text: str | int, what: str = "length") -> int:
    """`'512k'` -> 524288, `'1M'` -> 1048576, `'2048'` or `2048` -> 2048; positive only."""
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip()
        try:
            value = int(s[:-1]) * _SUFFIX[s[-1]] if s and s[-1] in _SUFFIX else int(s)
        except ValueError:
            raise GenolongError(
                f"{what} {text!r} is not a token count: write an integer or use k (x1024) / M (x1048576), e.g. 512k or 1M"
            ) from None
    if value <= 0:
        raise GenolongError(f"{what} must be positive, got {text!r}")
    return value


def format_length(n: int) -> str:
    """Inverse of parse_length for display: 524288 -> '512k', 1048576 -> '1M', 1000 -> '1000'."""
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)}M"
    if n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)
