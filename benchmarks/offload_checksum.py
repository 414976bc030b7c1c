"""What the offload's record checksum costs: `remat._diskio.write_at` (SHA-256) against the same
positioned writes with a CRC-32, and each hash alone, on one thread.

    .venv/bin/python -m benchmarks.offload_checksum [--mib 64] [--rounds 7] [--dir /dev/shm]

Writes go to --dir (default /dev/shm when it exists: a RAM disk, so the hash, not the disk, is
what differs). Rounds interleave the variants, order swapped each round; medians are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib

import torch

from remat import _diskio


def _crc_write(fd: int, offset: int, data: torch.Tensor) -> int:
    """`write_at` as it was with a CRC-32."""
    view = memoryview(data.numpy()).cast("B")
    crc, pos = 0, 0
    while pos < len(view):
        written = os.pwrite(fd, view[pos : pos + _diskio.CHUNK_BYTES], offset + pos)
        crc = zlib.crc32(view[pos : pos + written], crc)
        pos += written
    return crc


def _timed_write(fn, directory: str, data: torch.Tensor) -> float:
    fd, path = tempfile.mkstemp(dir=directory, prefix="remat-ck-")
    try:
        start = time.perf_counter()
        fn(fd, 0, data)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()
    data = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    view = memoryview(data.numpy()).cast("B")
    variants = {
        "write + sha256 (write_at)": lambda: _timed_write(_diskio.write_at, args.dir, data),
        "write + crc32": lambda: _timed_write(_crc_write, args.dir, data),
        "sha256 alone": lambda: _timed(lambda: hashlib.sha256(view).digest()),
        "crc32 alone": lambda: _timed(lambda: zlib.crc32(view)),
        "blake2b alone": lambda: _timed(lambda: hashlib.blake2b(view).digest()),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            times[name].append(variants[name]())
    for name, ts in times.items():
        print(f"{name:28s} {(args.mib << 20) / statistics.median(ts) / 1e9:6.2f} GB/s")
    print(f"median of {args.rounds} interleaved rounds, {args.mib} MiB, one thread, writes to {args.dir}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
