"""Raw I/O of the offload files: positioned writes and reads with a CRC-32, and a durable flush.

Below every stage: the disk offload (`remat.apply.offload_disk`) stores activations through it
and the bandwidth probe (`remat.measure.bandwidth`) times it, so the planner's disk rates
describe the path the offload takes.
"""

from __future__ import annotations

import os
import zlib

import torch

__all__ = ["CHUNK_BYTES", "OffloadError", "flush", "read_at", "write_at"]

CHUNK_BYTES = 8 << 20
"""Bytes per write/read system call (and per CRC update)."""


class OffloadError(RuntimeError):
    """An offloaded tensor could not be stored or restored; the message names the file and block."""


def write_at(fd: int, offset: int, data: torch.Tensor) -> int:
    """``pwrite`` a 1-D uint8 CPU tensor at ``offset``; return the CRC-32 of its bytes."""
    view = memoryview(data.numpy()).cast("B")
    crc, pos = 0, 0
    while pos < len(view):
        written = os.pwrite(fd, view[pos : pos + CHUNK_BYTES], offset + pos)
        crc = zlib.crc32(view[pos : pos + written], crc)
        pos += written
    return crc


def flush(fd: int) -> None:
    """Make the file durable and drop its pages from the cache."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_at(path: str, offset: int, nbytes: int, block: str) -> tuple[torch.Tensor, int]:
    """Read ``nbytes`` at ``offset`` into a new uint8 tensor; return it and the CRC-32 read."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < offset + nbytes:
            raise OffloadError(
                f"offload file {path} of block {block!r} holds {size} bytes but its record at "
                f"offset {offset} needs {offset + nbytes} (short or truncated file); the saved "
                "activations are lost: run the step again."
            )
        crc, pos = 0, 0
        while pos < nbytes:
            got = os.preadv(fd, [view[pos : pos + CHUNK_BYTES]], offset + pos)
            if not got:
                raise OffloadError(f"short read from offload file {path} of block {block!r} at offset {offset + pos}.")
            crc = zlib.crc32(view[pos : pos + got], crc)
            pos += got
    finally:
        os.close(fd)
    return out, crc
