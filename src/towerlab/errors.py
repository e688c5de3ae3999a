"""The one exception type for mistakes a user can fix.

The CLI turns a `UserError` into a single line on stderr and exit status 2.
Anything else that escapes is our bug and keeps its traceback.
"""

import difflib
from typing import Iterable


class UserError(Exception):
    """Bad input: an unknown name, an impossible setting, a missing or corrupt file.

    The message says what was wrong and what to do about it, in one line.
    """


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """` (did you mean 'mnist'?)` where one of `choices` is close to `value` (a typo), else ``: the
    hint an unknown name's message carries next to the list of names."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
