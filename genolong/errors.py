"""The one exception type that the CLI turns into a single line on stderr.

Raise `GenolongError` for anything a user can fix (bad input, impossible config): the message
names the problem *and* the fix, in one line. Everything else is a bug and keeps its traceback.
"""


class GenolongError(Exception):
    """A problem the user can fix; `str(err)` is one line: what is wrong, then what to do."""
