"""Host store for offloaded activations: pinned buffers from a reusable pool, side-stream copies.

For a model on an accelerator (CUDA). A saved storage is copied device->host on a side stream
(which first waits for the compute stream, so the copy sees the finished values) into a pinned
buffer taken from `PinnedPool`; ``record_stream`` tells the caching allocator that the device
memory is in use by the side stream, so the compute stream drops its reference at once and the
memory is reused only after the copy ends. In backward `HostTicket.prefetch` allocates the device
buffer on the compute stream, copies host->device on the side stream and records an event that
`HostTicket.get` makes the compute stream wait for; the pinned buffer goes back to the pool when
that event has completed. No CPU thread ever blocks on a copy except in `get` of a tensor whose
prefetch has not finished.
"""

from __future__ import annotations

import threading

import torch

POOL_GRANULE_BYTES = 1 << 20
"""Pinned buffers are rounded up to a multiple of this, so sizes that recur each step reuse them."""


def cuda_offload_available() -> bool:
    """True when host offload can run: CUDA is present (checked without initialising it early)."""
    return torch.cuda.is_available()


def require_cuda(strategy: str = "offload:cpu") -> None:
    """Raise the error a CPU-only machine gives for host offload."""
    if not cuda_offload_available():
        raise ValueError(
            f"{strategy!r} moves activations from an accelerator to host memory, but this machine "
            "has no CUDA device (the model already lives in host memory); use 'offload:disk' to "
            "save host RAM, or 'recompute'."
        )


def _bucket(nbytes: int) -> int:
    return max(POOL_GRANULE_BYTES, -(-nbytes // POOL_GRANULE_BYTES) * POOL_GRANULE_BYTES)


class PinnedPool:
    """Pinned host buffers, reused across steps; a buffer returns to the pool when its event ends."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self._lock = threading.RLock()  # a ticket's __del__ may release inside acquire (GC)
        self.allocated_bytes = 0
        """Pinned bytes ever allocated by this pool (its footprint)."""

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes`` (exactly `_bucket(nbytes)`)."""
        size = _bucket(nbytes)
        with self._lock:
            self._recycle()
            free = self._free.get(size)
            if free:
                return free.pop()
            self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor, event: torch.cuda.Event | None) -> None:
        """Give ``buf`` back once ``event`` (the last copy reading it) has completed."""
        with self._lock:
            if event is None:
                self._free.setdefault(buf.numel(), []).append(buf)
            else:
                self._pending.append((event, buf))

    def _recycle(self) -> None:
        pending, self._pending = self._pending, []
        for event, buf in pending:
            if event.query():
                self._free.setdefault(buf.numel(), []).append(buf)
            else:
                self._pending.append((event, buf))

    def clear(self) -> None:
        """Drop every idle buffer (pending ones are dropped when their copies end)."""
        with self._lock:
            for event, _buf in self._pending:
                event.synchronize()
            self._pending.clear()
            self._free.clear()
            self.allocated_bytes = 0


class HostTicket:
    """One device storage copied to a pinned buffer, and back on demand."""

    def __init__(self, store: HostStore, data: torch.Tensor, block: str) -> None:
        self.block = block
        self.nbytes = data.numel()
        self.device = data.device
        self._store = store
        self._buf = store.pool.acquire(self.nbytes)
        side = store.side_stream(data.device)
        side.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(side):
            self._buf[: self.nbytes].copy_(data, non_blocking=True)
            self._d2h = torch.cuda.Event()
            self._d2h.record(side)
        data.record_stream(side)
        self._dev: torch.Tensor | None = None
        self._h2d: torch.cuda.Event | None = None

    def prefetch(self) -> None:
        """Start the host->device copy on the side stream (once)."""
        if self._dev is not None or self._buf is None:
            return
        side = self._store.side_stream(self.device)
        dev = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dev.copy_(self._buf[: self.nbytes], non_blocking=True)
            self._h2d = torch.cuda.Event()
            self._h2d.record(side)
        self._store.pool.release(self._buf, self._h2d)
        self._buf, self._dev = None, dev

    def get(self) -> torch.Tensor:
        """The bytes back on the device, ordered after the copy on the current stream."""
        self.prefetch()
        torch.cuda.current_stream(self.device).wait_event(self._h2d)
        return self._dev

    def __del__(self) -> None:
        buf = getattr(self, "_buf", None)
        if buf is not None:  # dropped unread: the buffer is free once the D2H copy ended
            self._store.pool.release(buf, self._d2h)


class HostBlock:
    """One block's forward: its storages copied to pinned memory (same interface as a block file)."""

    def __init__(self, store: HostStore, block: str) -> None:
        self.store, self.block = store, block

    def put(self, data: torch.Tensor) -> HostTicket:
        """Start copying ``data`` (1-D uint8 on a CUDA device) to pinned host memory."""
        if data.device.type != "cuda":
            raise ValueError(
                f"offload:cpu got a tensor on {data.device} in block {self.block!r}; host offload "
                "moves CUDA activations only: use offload:disk for a model in host memory."
            )
        return HostTicket(self.store, data, self.block)

    def seal(self) -> None:
        """Nothing to flush: the copies are ordered by their events."""


class HostStore:
    """Offload to pinned host memory: one side stream per device, one pinned pool."""

    def __init__(self) -> None:
        self.pool = PinnedPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def open_block(self, block: str) -> HostBlock:
        """The copies of one forward of ``block``."""
        return HostBlock(self, block)

    def check(self) -> None:
        """Host copies raise no deferred errors (CUDA errors surface on the next sync)."""

    def wait_writes(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def purge(self) -> None:
        self.wait_writes()
        self.pool.clear()

    def close(self) -> None:
        self.purge()
