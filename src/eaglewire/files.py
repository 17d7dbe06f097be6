"""Artefact I/O: how eaglewire writes its files and directories, and reads JSON and safetensors.

Writing. A file is written to a temporary file in its own folder, flushed, fsynced and renamed over
its final name with os.replace. The temporary file has a hidden name ending in `.tmp`, which a
resuming writer may delete as the remains of a killed run. A directory (a checkpoint, an export, a
resume state) is built in a temporary sibling, every file in it fsynced, and renamed into place.
Inside it files are written plainly: the directory is the unit that appears whole or not at all.

fsync policy, the same everywhere: file data is fsynced before the rename that publishes it, so a
crash right after the rename cannot expose a file whose blocks never reached the disk. The folder
itself is not fsynced: a crash may lose the rename, leaving the previous version (or nothing),
which every reader already accepts.

Reading. `read_json` and `read_safetensors` turn any failure into one UsageError line naming the
file and what to do about it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import UsageError


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file, read in 4 MiB chunks (shards and models are large)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def text_lines(text: str) -> list[str]:
    """A JSONL or text file's lines: split at "\\n" (a "\\r" before it dropped) only. `str.splitlines` also splits
    at U+2028, U+0085 and other separators that a JSON string may hold raw (json.dumps(..., ensure_ascii=False)
    writes them so). Those cut one record in two "malformed" halves."""
    return [line.removesuffix("\r") for line in text.split("\n")]


# ---- writing ------------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temp(path: Path) -> Path:
    """A new empty file beside `path`. Created with mode 0o666 less the umask, as a plain open() would
    (tempfile.mkstemp's 0o600 would leave a rewritten config.json readable by its owner only)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` for a writer that wants a file name (safetensors, matplotlib: give
    it the format, the name ends in .tmp); once the block ends, the file is fsynced and renamed to `path`.
    On an error the temporary file is deleted and `path` is as it was."""
    path = Path(path)
    tmp = _new_temp(path)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: str | Path, mode: str = "wb"):
    """Open a temporary file beside `path` for writing ("wb", or "w" for UTF-8 text); renamed to `path` once
    the block ends (see atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
        yield f


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write `data` (str: as UTF-8) to `path` whole or not at all."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_json(path: str | Path, obj, indent: int | None = 2) -> None:
    """`obj` as indented JSON with a final newline, written atomically."""
    atomic_write(path, json.dumps(obj, indent=indent) + "\n")


@contextmanager
def atomic_dir(out: str | Path, *, tmp: Path | None = None, old: Path | None = None) -> Iterator[Path]:
    """Build a directory in a temporary sibling of `out`, then rename it into place.

    Yields the temporary directory. When the block ends every file in it is fsynced; an existing `out`
    is moved aside, the new one renamed in, the previous one deleted. If renaming the new one in fails,
    the previous one is put back. On any error the temporary directory is deleted.
    `tmp`, `old`: fixed paths for the temporary directory and for the previous `out` while it waits.
    They serve a caller whose readers look there after a kill (the trainer's resume state falls back
    to its .old). By default they are fresh hidden siblings named after `out`. A fixed `old` is kept
    when the write fails.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    else:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of a killed write
        tmp.mkdir(parents=True)
    holder = aside = None  # holder: a fresh folder for the previous `out` (default); aside: where it waits
    try:
        yield tmp
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                _fsync(f)
        if out.exists():
            if old is None:
                holder = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
                aside = holder / "ckpt"
            else:
                shutil.rmtree(old, ignore_errors=True)
                aside = old
            os.replace(out, aside)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and aside.exists() and not out.exists():
            os.replace(aside, out)  # put the previous one back
        if holder is not None and not any(holder.iterdir()):
            holder.rmdir()
        raise
    if holder is not None:
        shutil.rmtree(holder, ignore_errors=True)
    elif old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- reading ------------------------------------------------------------------------------------

def read_json(path: str | Path, *, fix: str):
    """The JSON value in `path`; any failure is one UsageError line naming the file and `fix`."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{path}: unreadable JSON ({e}); {fix}") from None


def read_safetensors(path: str | Path, *, fix: str) -> dict:
    """Every tensor in a safetensors file, on the CPU; any failure is one UsageError line naming the file and
    `fix`. Nothing is unpickled."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise UsageError(f"{path}: unreadable safetensors file ({e}); {fix}") from None
