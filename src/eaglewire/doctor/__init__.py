"""`eaglewire doctor`: find every known wiring fault of a draft, statically and by measurement.

`diagnose(draft, target=..., engine=..., ...) -> Report` is the Python entry point; cli.py maps
the `doctor` command here (`register`).
"""

from .cli import Report, diagnose, register, render  # noqa: F401
from .findings import CODES, Finding, Remedy  # noqa: F401
