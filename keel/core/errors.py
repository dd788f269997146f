"""Error types that carry a message meant for the user.

Library code raises these for mistakes a user can fix (a bad config, a missing file). The CLI prints
`str(error)` as one line and exits with `error.exit_code`, never a traceback. Bugs stay ordinary
exceptions so that their tracebacks reach whoever must fix them.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KeelError(Exception):
    """Base class: a failure explained in one line (what, where, what to do).

    `exit_code` is what the CLI exits with: 2 for usage mistakes, 1 for work that failed.
    """

    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(KeelError):
    """The user asked for something that cannot be done as asked (bad argument, missing file)."""

    exit_code = 2


class ConfigError(UsageError):
    """A config is malformed, names a key that does not exist, or holds a wrongly typed value."""


class UnhashableConfigError(ConfigError):
    """A config holds a value that has no canonical form (a function, an open file, ...)."""


class LockLostError(KeelError):
    """This process no longer holds a lock it thought it held (another runner took it over)."""


def one_line(error: BaseException | str) -> str:
    """The first line of an error's text (its class name if it has none)."""
    text = str(error).strip()
    if text:
        return text.splitlines()[0]
    return type(error).__name__ if isinstance(error, BaseException) else "error"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'X'?)` for the choice closest to a mistyped `word`, or "" when none is
    close: the hint an error message about an unknown name carries."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
