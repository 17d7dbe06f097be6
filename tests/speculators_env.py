"""A separate virtualenv with vllm-project/speculators 0.9.0, for the interop cross-check.

speculators pins transformers 5.19 (ours: newer), so it lives in its own venv, built once and cached
under $EAGLEWIRE_HOME/venvs (never in the repo). The tests talk to it only through a subprocess
running tests/speculators_probe.py, exchanging tensors as safetensors files.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The install recipe from the issue: speculators' own deps clash with ours, so they are named
# explicitly and the two packages themselves go in with --no-deps.
REQUIREMENTS = ["torch==2.13.0", "transformers==5.19.0", "pydantic", "pydantic-settings", "loguru", "rich", "typer",
                "tqdm", "click", "psutil", "openai", "datasets<=5.1.0", "safetensors"]
NO_DEPS = ["speculators==0.9.0", "hs-connectors==0.9.0"]
STAMP = " ".join(REQUIREMENTS + ["--no-deps"] + NO_DEPS)
PROBE = Path(__file__).with_name("speculators_probe.py")


def _home() -> Path:
    return Path(os.environ.get("EAGLEWIRE_HOME", Path.home() / ".cache" / "eaglewire"))


def _pip(py: Path, args: list[str], log) -> bool:
    r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args],
                       stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    return r.returncode == 0


def _registry_reachable(py: Path, tmp: Path) -> bool:
    r = subprocess.run([str(py), "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), "hs-connectors==0.9.0"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return r.returncode == 0


def speculators_python() -> Path:
    """The venv's python, building the venv on first use (a file lock serialises parallel runs)."""
    root = _home() / "venvs" / "speculators-0.9.0"
    py = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".speculators.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = root / ".eaglewire-stamp"
        if stamp.is_file() and stamp.read_text() == STAMP and py.exists():
            return py
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=600)
        log_path = root / "install.log"
        with open(log_path, "w") as log:
            ok = _pip(py, REQUIREMENTS, log) and _pip(py, ["--no-deps", *NO_DEPS], log)
        if not ok:
            if not _registry_reachable(py, root / "probe-download"):
                shutil.rmtree(root, ignore_errors=True)
                pytest.skip("the package registry is unreachable: cannot install speculators==0.9.0 for the "
                            "cross-check")
            tail = log_path.read_text()[-3000:]
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"installing speculators 0.9.0 into its venv failed:\n{tail}")
        stamp.write_text(STAMP)
        return py


def run_probe(py: Path, *args: str, timeout: int = 600) -> str:
    r = subprocess.run([str(py), str(PROBE), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"})
    if r.returncode != 0:
        raise AssertionError(f"speculators probe {args[0]} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n"
                             f"{r.stderr[-4000:]}")
    return r.stdout
