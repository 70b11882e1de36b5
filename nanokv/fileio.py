"""Files written whole or not at all (a leaf module: the standard library only)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable


def write_durably(path: str | os.PathLike, chunks: Iterable[bytes], mode: int = 0o644) -> None:
    """Write `chunks` to a temporary file beside `path`, fsync it, rename it over `path`
    (atomic: a reader sees the old file or the new one, never a part) and fsync the folder
    so that the rename survives a crash. The temporary file is removed if anything fails."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    fd, staged = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}-")
    try:
        with open(fd, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(staged, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
