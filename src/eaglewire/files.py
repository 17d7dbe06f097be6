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


def text_lines(text: str) -> list[str]:
    """A JSONL or text file's lines: split at "\\n" (a "\\r" before it dropped) only. str.splitlines also splits at
    U+2028, U+0085 and other separators that a JSON string may hold raw (json.dumps(..., ensure_ascii=False)
    writes them so), which cut one record in two "malformed" halves."""
    return [line.removesuffix("\r") for line in text.split("\n")]
