"""Transfer rates for the offload strategies, measured on this machine (fills `Bandwidths`).

- Disk: sequential write then read of one file in the offload directory, through the very I/O
  path the disk offload uses (`remat._diskio`: ``write_at`` with its SHA-256, then ``flush``:
  fdatasync + POSIX_FADV_DONTNEED, so the read comes from the disk, not the page cache;
  ``read_at``). A 4 MiB pilot sets the size so that the timed write takes about ``target_s``; the
  whole probe stays under a second on anything faster than ~40 MB/s.
- Overlap, disk: the rate of a small matmul loop while records are written by a pool of
  `WRITER_THREADS` threads, as the disk offload's store writes them, over its rate alone.
  Compute that loses nothing to the writes hides them fully (1.0); compute that stalls for them
  hides nothing.
- Overlap, CUDA (`measure_copy_overlap`): a device->host and a host->device copy on a side
  stream beside matmuls of about the same length on the current stream, timed alone and
  together with CUDA events: the share of the shorter that the two hide of each other.
- Host<->device (CUDA only): pinned copies timed with CUDA events.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from remat._diskio import flush, make_private_dir, read_at, remove_private_dir, write_at
from remat.measure.probes import Attempts
from remat.measure.types import Bandwidths, Profile

__all__ = ["measure_bandwidths", "measure_copy_overlap", "measure_disk", "measure_disk_overlap", "measure_host_device",
           "overlap_share", "with_bandwidths"]

PILOT_BYTES = 4 << 20
MIN_PROBE_BYTES = 8 << 20
MAX_PROBE_BYTES = 256 << 20
WRITER_THREADS = 2
"""I/O threads writing records, the disk offload's default (`remat.apply.offload_disk.DiskStore`;
a test keeps them equal)."""


def _payload(nbytes: int) -> torch.Tensor:
    """Incompressible-looking bytes, cheap to make: one random MiB repeated."""
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    return block.repeat(-(-nbytes // block.numel()))[:nbytes].contiguous()


def _timed_roundtrip(directory: str, nbytes: int) -> tuple[float, float]:
    """Seconds to write (durably) and read back one ``nbytes`` file in ``directory``."""
    data = _payload(nbytes)
    fd, path = tempfile.mkstemp(prefix="remat-bw-", dir=directory)
    try:
        start = time.perf_counter()
        write_at(fd, 0, data)
        flush(fd)
        mid = time.perf_counter()
        read_at(path, 0, nbytes, "bandwidth probe")
        end = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    return mid - start, end - mid


def measure_disk(directory: str | os.PathLike, *, target_s: float = 0.15) -> tuple[float, float]:
    """(write, read) bytes per second of sequential I/O in ``directory``."""
    directory = str(directory)
    if not Path(directory).is_dir():
        raise ValueError(f"offload directory {directory!r} does not exist; create it or pick another.")
    pilot_w, _ = _timed_roundtrip(directory, PILOT_BYTES)
    rate = PILOT_BYTES / max(pilot_w, 1e-6)
    nbytes = int(min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, rate * target_s)))
    write_s, read_s = _timed_roundtrip(directory, nbytes)
    return nbytes / write_s, nbytes / read_s


def _compute_rate(device: torch.device, until, min_s: float) -> float:
    """Iterations per second of a small CPU matmul loop run until ``until()`` and ``min_s`` elapsed."""
    a = torch.randn(128, 128, device=device)
    iters, start = 0, time.perf_counter()
    while not until() or time.perf_counter() - start < min_s:
        a = torch.tanh(a @ a * (1.0 / 128))
        iters += 1
    return iters / (time.perf_counter() - start)


def measure_disk_overlap(directory: str | os.PathLike, write_bytes_per_s: float, *, target_s: float = 0.08) -> float:
    """Share of offload write time hidden behind compute running at the same time.

    Measured as the compute loop's rate while the offload's writer threads run, over its rate
    alone: 1 when the writes cost the compute nothing, 0 when compute stalls for them."""
    device = torch.device("cpu")
    nbytes = int(min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, write_bytes_per_s * target_s)))
    chunks = list(_payload(nbytes).chunk(4))
    _compute_rate(device, lambda: True, 0.01)  # warm-up
    alone = _compute_rate(device, lambda: True, target_s / 2)
    offsets = [sum(c.numel() for c in chunks[:i]) for i in range(len(chunks))]
    fd, path = tempfile.mkstemp(prefix="remat-bw-", dir=str(directory))
    try:
        with ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="remat-bw") as pool:
            writes = [pool.submit(write_at, fd, offset, chunk) for offset, chunk in zip(offsets, chunks)]
            during = _compute_rate(device, lambda: all(w.done() for w in writes), 0.0)
            for write in writes:
                write.result()
        flush(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return min(1.0, max(0.0, during / alone))


def _cuda_copy_s(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)  # warm-up
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure_host_device(device: torch.device, nbytes: int = 64 << 20) -> tuple[float, float, float]:
    """(host->device, device->host bytes/s, hidden share of side-stream copies) on CUDA."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d_s = _cuda_copy_s(dev, host)
    d2h_s = _cuda_copy_s(host, dev)
    return nbytes / h2d_s, nbytes / d2h_s, measure_copy_overlap(device, host, dev, d2h_s + h2d_s)


def overlap_share(compute_s: float, transfer_s: float, together_s: float) -> float:
    """Share of the shorter of compute and transfer hidden when both run at once: what
    `remat.plan.offload_cost.exposed_ms` takes (``together = compute + transfer - share * min``),
    clamped to 0..1."""
    shorter = min(compute_s, transfer_s)
    if shorter <= 0:
        return 0.0
    return min(1.0, max(0.0, (compute_s + transfer_s - together_s) / shorter))


def measure_copy_overlap(device: torch.device, host: torch.Tensor, dev: torch.Tensor, transfer_s: float,
                         *, repeats: int = 3) -> float:
    """Share of pinned copies' time hidden behind compute on the GPU, as the offload runs them.

    A device->host then a host->device copy of ``dev`` (``transfer_s`` alone) run on a side stream
    while the current stream runs matmuls sized to take about as long; the share is
    `overlap_share` of the three times (compute alone, copies alone, both at once), each timed
    with CUDA events on the current stream, the median of ``repeats``. Only the streams
    involved are waited for: a device-wide synchronize inside the timed region would serialise
    the very copies being measured."""
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    a = torch.randn(1024, 1024, device=device)

    def compute(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    def copies() -> None:
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
            dev.copy_(host, non_blocking=True)

    def timed(work: Callable[[], None], *, on_side: bool = False) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        side.wait_event(start)
        work()
        if on_side:
            main.wait_stream(side)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    compute(2)
    per_mm = max(timed(lambda: compute(8)) / 8, 1e-7)
    n = max(1, min(100_000, round(transfer_s / per_mm)))

    def both() -> None:
        copies()
        compute(n)

    rounds = [(timed(lambda: compute(n)), timed(copies, on_side=True), timed(both, on_side=True))
              for _ in range(repeats)]
    shares = sorted(overlap_share(*times) for times in rounds)
    return shares[len(shares) // 2]


def _host_fields(device: torch.device) -> dict:
    h2d, d2h, overlap = measure_host_device(device)
    return dict(host_to_device_bytes_per_s=h2d, device_to_host_bytes_per_s=d2h, overlap_fraction=overlap)


def _disk_fields(directory: Path, attempts: Attempts | None = None) -> dict:
    """Disk rates of ``directory``, measured in a private directory inside it (removed after, on
    SIGTERM and at exit, as the offload's); a missing ``directory`` whose parent exists is made
    (0700) and removed after, as the offload itself does (one that cannot be made is the caller's
    error). With ``attempts``, a probe that raises leaves the rates out and marks ``offload:disk``
    failed."""
    try:
        private, made = make_private_dir(directory)
    except OSError as exc:
        raise ValueError(f"cannot create offload directory {str(directory)!r}: {exc.strerror}; choose a writable one.") from exc
    try:
        return (attempts or Attempts.raising()).run("offload:disk", _disk_rates, Path(private), directory) or {}
    finally:
        remove_private_dir(private, made)


def _disk_rates(private: Path, directory: Path) -> dict:
    write, read = measure_disk(private)
    return dict(disk_write_bytes_per_s=write, disk_read_bytes_per_s=read, disk_dir=str(directory.resolve()),
                disk_overlap_fraction=measure_disk_overlap(private, write))


def measure_bandwidths(device: torch.device | str = "cpu", offload_dir: str | os.PathLike | None = None) -> Bandwidths:
    """Every rate this machine has: host<->device on CUDA, disk when ``offload_dir`` is given
    (made for the measurement and removed after when it does not exist)."""
    device = torch.device(device)
    fields: dict = _host_fields(device) if device.type == "cuda" else {}
    if offload_dir is not None:
        fields.update(_disk_fields(Path(offload_dir)))
    return Bandwidths(**fields)


def with_bandwidths(profile: Profile, device: torch.device | str = "cpu",
                    offload_dir: str | os.PathLike | None = None) -> Profile:
    """``profile`` with the rates `measure_bandwidths` measures; a probe that raises (a disk that
    fails mid-probe, a copy the device refuses) leaves its rates out and marks its target
    (``offload:cpu``, ``offload:disk``) unavailable on every block, with the reason."""
    device, attempts = torch.device(device), Attempts()
    fields: dict = (attempts.run("offload:cpu", _host_fields, device) or {}) if device.type == "cuda" else {}
    if offload_dir is not None:
        fields.update(_disk_fields(Path(offload_dir), attempts))
    failed = tuple(sorted(attempts.failed().items()))
    blocks = tuple(dataclasses.replace(b, unavailable=b.unavailable + failed) for b in profile.blocks)
    return dataclasses.replace(profile, bandwidths=Bandwidths(**fields), blocks=blocks)
