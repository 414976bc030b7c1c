"""Fresh memory: what the host allocator makes a step fault in, and what a faulted byte costs.

On the CPU a training step allocates its activations from the C allocator. What the step's
high-water mark needs beyond what the allocator kept from the previous step comes from the
kernel as fresh pages, and each first touch of a page is a page fault (glibc returns the top of
its heap to the kernel once more than its trim threshold, at most 64 MiB, is free, so a step
whose activations reach past that faults them in again every step). Measured on the built-in
GPT (149 MiB peak): 80 MiB of faults per step without recomputation, none with full
recomputation (42 MiB peak); at about 0.25 ms per MiB on the development VM that is 20 ms of a
220 ms step, time a lower peak saves and the replayed forwards do not pay.

`fault_bytes` reads the process's minor page faults (Linux, macOS: ``getrusage``);
`first_touch_ms_per_byte` times filling a fresh 64 MiB buffer (mapped on its own by any
allocator, so every page faults) against filling it again. On CUDA both are 0: the caching
allocator keeps device memory between steps and no page is faulted in a steady state.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Iterator

import torch

__all__ = ["fault_bytes", "FaultCount", "first_touch_ms_per_byte", "PROBE_BYTES"]

PROBE_BYTES = 64 * 2**20
"""Size of the first-touch probe: above glibc's largest mmap threshold (32 MiB)."""

try:
    import resource as _resource
except ImportError:  # Windows: no getrusage
    _resource = None

try:
    import mmap as _mmap

    _PAGE = _mmap.PAGESIZE
except ImportError:  # pragma: no cover - every supported platform has mmap
    _PAGE = 4096


def fault_bytes() -> int | None:
    """Bytes this process has faulted in so far (minor page faults times the page size), or
    None where the platform does not count them."""
    if _resource is None:
        return None
    return int(_resource.getrusage(_resource.RUSAGE_SELF).ru_minflt) * _PAGE


class FaultCount:
    """Context manager: ``bytes`` faulted in fresh inside it (None when not counted: ``enabled``
    False, or a platform without the count)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.bytes: int | None = None
        self._start: int | None = None

    def __enter__(self) -> FaultCount:
        self._start = fault_bytes() if self.enabled else None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None:
            self.bytes = max(0, (fault_bytes() or 0) - self._start)


def first_touch_ms_per_byte(device: torch.device, repeats: int = 5, discard: int = 1) -> float:
    """Milliseconds per byte that faulting in fresh host memory adds to writing it (median of
    ``repeats`` after ``discard`` discarded probes; 0 on devices other than the CPU, and where faults are
    not counted). A probe can take several times as long as the next (1.7-2.3 against 0.25-0.38
    ms per MiB, in 5 of 12 profiles of the built-in GPT that probed once after their timed
    steps), which is why `remat.measure.profile` probes beside each timed step and keeps the
    median."""
    if torch.device(device).type != "cpu" or fault_bytes() is None:
        return 0.0
    costs = []
    with _gc_paused():
        for _ in range(repeats + discard):
            costs.append(_probe())
    return statistics.median(costs[discard:])


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic collector off (a collection of a profile's records inside a probe takes
    longer than the probe)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _probe() -> float:
    """One first-touch probe: ms per byte of filling a fresh buffer less filling it again."""
    start = time.perf_counter()
    buffer = torch.empty(PROBE_BYTES // 4, dtype=torch.float32)
    buffer.fill_(1.0)
    fresh = time.perf_counter() - start
    start = time.perf_counter()
    buffer.fill_(2.0)
    warm = time.perf_counter() - start
    del buffer
    return max(fresh - warm, 0.0) * 1e3 / PROBE_BYTES
