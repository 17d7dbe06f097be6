"""Errors a user can fix. The CLI prints them as one line and exits non-zero, never a traceback."""


class EaglewireError(Exception):
    """A user-facing error: bad input, a mis-wired artefact, an unsupported request."""

    exit_code = 1


class UsageError(EaglewireError):
    """Bad command-line usage or an input file a user must fix (exit code 2)."""

    exit_code = 2


class TapError(UsageError):
    """A tap list that is invalid, or that a convention cannot express."""


class UnknownArchitectureError(EaglewireError):
    """A target model whose decoder stack eaglewire cannot locate."""
