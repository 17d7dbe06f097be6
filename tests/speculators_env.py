"""One separate virtualenv for the peer trainers: vllm-project/speculators 0.9.0 and SpecForge 0.2.0.

Both pin versions that clash with ours (speculators: transformers <= 5.19; SpecForge: torch 2.11.0,
transformers 5.8.1 and sglang), so they share one venv, built once and cached under
$EAGLEWIRE_HOME/venvs (never in the repo). The tests talk to it only through subprocesses
(tests/speculators_probe.py; `specforge` and benchmarks/peers/peer_specforge.py), exchanging files.

SpecForge goes in with --no-deps: its offline training and `specforge export` import only what is
listed below (read from sys.modules after a real run); its hard deps sglang, yunchang, wandb,
openai-harmony and tensorboard are never imported on that path. It runs on transformers 5.19 and
torch 2.13 here. Its EAGLE-3 loss is a Triton kernel launched unconditionally
(specforge/core/loss.py:185), so a CPU run needs the real triton package, run by Triton's own
interpreter (TRITON_INTERPRET=1): the largest install here (286 MB download).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# speculators' own deps clash with ours, so they are named explicitly and the packages themselves go
# in with --no-deps. accelerate (specforge/cli.py:114 set_seed), pyyaml (config/schema.py:937) and
# triton (core/loss.py:10) are SpecForge's; datasets serves both (SpecForge: data/preprocessing.py:34,
# imported to build the draft vocabulary). speculators imports httpx on its train path (train/utils.py:10 ->
# data_generation/render_client.py:12); openai 3 depends on httpx2 instead, so openai stays on 2.x, which
# uses httpx (the versions the GPU machine runs).
REQUIREMENTS = ["torch==2.13.0", "transformers==5.19.0", "pydantic", "pydantic-settings", "loguru", "rich", "typer",
                "tqdm", "click", "psutil", "openai==2.54.0", "httpx", "datasets<=5.1.0", "safetensors", "accelerate",
                "pyyaml", "triton==3.9.0"]
NO_DEPS = ["speculators==0.9.0", "hs-connectors==0.9.0", "specforge==0.2.0"]
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


def peers_python() -> Path:
    """The venv's python, building the venv on first use (a file lock serialises parallel runs)."""
    root = _home() / "venvs" / "peers"
    py = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".peers.lock", "w") as lock:
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
                pytest.skip("the package registry is unreachable: cannot install the peer trainers (speculators "
                            "0.9.0, SpecForge 0.2.0)")
            tail = log_path.read_text()[-3000:]
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"installing the peer trainers into their venv failed:\n{tail}")
        stamp.write_text(STAMP)
        return py


speculators_python = peers_python  # the name the speculators tests know it by


def run_probe(py: Path, *args: str, timeout: int = 600) -> str:
    r = subprocess.run([str(py), str(PROBE), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"})
    if r.returncode != 0:
        raise AssertionError(f"speculators probe {args[0]} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n"
                             f"{r.stderr[-4000:]}")
    return r.stdout
