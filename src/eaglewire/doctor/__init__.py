"""`eaglewire doctor`: find every known wiring fault of a draft, statically and by measurement.

`diagnose(DoctorRequest(draft, target=..., engine=..., ...)) -> Report` (api.py) is the Python entry point;
cli.py maps the `doctor` command's flags to a request (`register`).
"""

from .api import DoctorRequest, Report, diagnose  # noqa: F401
from .cli import register, render  # noqa: F401
from .findings import CODES, Finding, Remedy  # noqa: F401
