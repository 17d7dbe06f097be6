"""Errors a user can fix. The CLI prints them as one line and exits non-zero, never a traceback."""

import os
import re
import tempfile


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


_RAISED = re.compile(r"\b[A-Z]\w*(?:Error|Exception): .*")  # how Python prints an exception that ended a program


def engine_exit(engine: str, code: int, served: str, log_text: str, log_file=None) -> EaglewireError:
    """An engine process that failed, in one line: the first and last exception it printed, and its log file
    (`log_file`, else a kept copy of `log_text`: the job's temporary folder is about to go).

    The first exception is usually the cause; the last is what stopped the process, often a wrapper ("Engine
    core initialization failed. See root cause above."). The log's last line is no guide: it is often a
    shutdown warning."""
    raised = [m.group(0).strip() for m in map(_RAISED.search, log_text.splitlines()) if m]
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    said = list(dict.fromkeys([raised[0], raised[-1]])) if raised else lines[-1:] or ["no output"]
    if log_file is None:
        fd, log_file = tempfile.mkstemp(prefix=f"eaglewire-{engine.lower()}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(log_text)
    return EaglewireError(f"{engine} exited with {code} serving {served}: " + " ... ".join(s[:200] for s in said)
                          + f" (its log: {log_file})")
