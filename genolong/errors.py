"""The one exception type that the CLI turns into a single line on stderr.

Raise `GenolongError` for anything a user can fix (bad input, impossible config): the message
names the problem *and* the fix, in one line. Everything else is a bug and keeps its traceback.
"""

import os


class GenolongError(Exception):
    """A problem the user can fix; `str(err)` is one line: what is wrong, then what to do."""


def env_choice(name: str, default: str, choices: dict[str, str]) -> str:
    """The environment setting `name` (`default` when unset), one of `choices` {value: what it does};
    anything else is a GenolongError naming the values."""
    value = os.environ.get(name, default)
    if value not in choices:
        options = " or ".join(f"{k} ({what})" for k, what in choices.items())
        raise GenolongError(f"{name}={value!r} is not a setting; set it to {options}, or unset it")
    return value
