"""Output files written whole or not at all: a temporary file in the same directory, fsync, then
`os.replace` onto the name. A failure at any point (a serializer that raises, a full disk, an
interrupt) leaves the old file, or none, and no temporary file.

Every file remat writes (profiles, plans, verifications, HTML reports, figures, benchmark
results) goes through `write_atomic` or `replacing`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

__all__ = ["replacing", "write_atomic"]


def _umask() -> int:
    """The process umask, read without changing it where /proc says it (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # not thread-safe, hence the fallback only
    os.umask(mask)
    return mask


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file object whose bytes become ``path`` when the block ends without an error.
    The new file gets the mode a plain ``open(path, "w")`` would give it."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # name the file asked for, not the temporary one
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: some file systems refuse to open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text is encoded with ``encoding``) to ``path`` atomically; returns the path."""
    payload = data.encode(encoding) if isinstance(data, str) else data
    with replacing(path) as f:
        f.write(payload)
    return Path(path)
