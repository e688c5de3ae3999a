"""Exit statuses shared by workers, the launcher and the command line, and the exception that
carries a signal's. Standard library only: the CLI names them before it imports torch, so that
`towerlab --help` and a mistyped flag answer at once."""

from __future__ import annotations

import signal

EXIT_USER_ERROR = 2
EXIT_PEER_LOST = 3
EXIT_SIGINT = 130
EXIT_SIGPIPE = 141  # stdout was closed by its reader (`towerlab train | head -1`)
EXIT_SIGTERM = 143
EXIT_STOPPED = (EXIT_SIGINT, EXIT_SIGPIPE, EXIT_SIGTERM)  # an orderly stop: saved, resumable


class Interrupted(Exception):
    """Raised by the training loop after it saved its state on SIGINT / SIGTERM (or a closed stdout)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_status = {signal.SIGINT: EXIT_SIGINT, signal.SIGPIPE: EXIT_SIGPIPE}.get(signum, EXIT_SIGTERM)
