"""File helpers shared by every artefact writer and reader."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file, read in 4 MiB chunks (shards and models are large)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
