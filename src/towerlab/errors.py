"""The one exception type for mistakes a user can fix.

The CLI turns a `UserError` into a single line on stderr and exit status 2.
Anything else that escapes is our bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: an unknown name, an impossible setting, a missing or corrupt file.

    The message says what was wrong and what to do about it, in one line.
    """
