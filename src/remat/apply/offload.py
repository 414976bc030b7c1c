"""Activation offloading: saved tensors of a block go to host memory or disk and come back in backward.

Built on `torch.autograd.graph.saved_tensors_hooks`. The seam for `remat.apply` is one class::

    engine = OffloadEngine("disk", directory="/nvme/tmp", min_bytes=1 << 20, num_threads=2)
    with engine.block_context("blocks.3", module=model.blocks[3]):
        out = model.blocks[3](x)          # forward of one block: its saved tensors are offloaded
    ...
    loss.backward()                       # unpack hooks bring them back, one block ahead
    engine.close()                        # deletes every file and the private directory

``block_context(name, module=None)`` installs the pack/unpack hooks around one block's forward and
tags every packed tensor with the block; wrap it around the block's ``forward`` (a forward
pre/post hook pair or a wrapper module). It composes with recomputation: blocks under
``torch.utils.checkpoint`` install their own, innermost hooks, so a plan can recompute some
blocks and offload others in the same step. ``close()`` deletes everything; the engine can be used
again afterwards (a fresh directory is made on the next write).

What is offloaded: a saved tensor whose storage is at least ``min_bytes``, strided, a plain
`torch.Tensor`, not a leaf that requires grad (parameters) and not a parameter or buffer of
``module``. The whole storage is moved once per block even when several saved tensors view it
(q, k, v slices of one projection), and each tensor is rebuilt in backward with its original
dtype, shape, strides and storage offset, so backward sees the same bytes in the same layout:
gradients are bit-identical to keeping the tensors. Smaller tensors stay where they are.

Targets: ``"disk"`` (`remat.apply.offload_disk.DiskStore`: one file per block forward, records
written by a thread pool, checksummed, deleted once read) for CPU or CUDA models; ``"cpu"``
(`remat.apply.offload_cpu.HostStore`: pinned pool, side-stream copies with events) for CUDA
models only: asking for it without CUDA raises ValueError.

Prefetch: the first unpack of a block in backward starts reading back every tensor of that block
and of the block that ran just before it in forward (the next one backward will need). A record
whose write has not started by then is not written at all: its bytes are still in memory.
Faults (missing, short or corrupted file, full disk, unwritable directory) raise
`OffloadError` naming the file and the block; every file of the engine is deleted first.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.apply.offload_cpu import HostStore, require_cuda
from remat.apply.offload_disk import DiskStore, OffloadError

__all__ = ["OffloadEngine", "OffloadError", "OffloadStats", "MIN_BYTES", "TARGETS"]

MIN_BYTES = 64 << 10
"""Default size threshold: storages under 64 KiB stay (statistics such as LayerNorm's mean and
rstd: each would cost a copy's latency to free almost nothing)."""

TARGETS = ("cpu", "disk")


@dataclass(kw_only=True, frozen=True)
class OffloadStats:
    """What one engine moved since it was made (or since `OffloadEngine.reset_stats`)."""

    offloaded_bytes: int
    """Bytes of storages sent to the target."""
    offloaded_storages: int
    """Storages sent to the target."""
    kept_tensors: int
    """Saved tensors left in place (small, parameters, buffers, non-strided)."""
    restored_tensors: int
    """Saved tensors rebuilt in backward."""


class _Packed:
    """What autograd holds instead of a saved tensor: the ticket and the tensor's geometry."""

    __slots__ = ("group", "ticket", "dtype", "size", "stride", "offset", "device", "__weakref__")

    def __init__(self, group: _Group, ticket: Any, t: torch.Tensor) -> None:
        self.group = group
        self.ticket = ticket
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.device = t.device


class _Group:
    """The tickets of one forward pass through one block, linked to the block run before it."""

    def __init__(self, name: str, prev: _Group | None, kept_ptrs: frozenset[int]) -> None:
        self.name = name
        self.file: Any = None  # the store's block file, opened on the first offloaded storage
        self.prev = weakref.ref(prev) if prev is not None else None
        self.kept_ptrs = kept_ptrs
        self.by_storage: dict[int, tuple[Any, torch.Tensor]] = {}
        self.tickets: weakref.WeakSet = weakref.WeakSet()
        self.prefetched = False

    def prefetch(self) -> None:
        if not self.prefetched:
            self.prefetched = True
            for ticket in list(self.tickets):
                ticket.prefetch()


def _module_storage_ptrs(module: nn.Module | None) -> frozenset[int]:
    if module is None:
        return frozenset()
    tensors = list(module.parameters()) + list(module.buffers())
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def _engine_like(target: str, directory: str | None, min_bytes: int, num_threads: int) -> "OffloadEngine":
    """A new `OffloadEngine` of these settings (`OffloadEngine.__reduce__`, `OffloadEngine.__deepcopy__`)."""
    return OffloadEngine(target, directory=directory, min_bytes=min_bytes, num_threads=num_threads)


class OffloadEngine:
    """Moves saved activations of the blocks it wraps to ``target`` (``"cpu"`` or ``"disk"``)."""

    def __init__(
        self,
        target: str,
        *,
        directory: str | os.PathLike | None = None,
        min_bytes: int = MIN_BYTES,
        num_threads: int = 2,
    ) -> None:
        if target not in TARGETS:
            raise ValueError(f"offload target {target!r} is unknown; use 'cpu' or 'disk'.")
        if target == "cpu":
            require_cuda()
            if directory is not None:
                raise ValueError("directory= is for offload target 'disk'; 'cpu' uses pinned host memory.")
        if min_bytes < 1:
            raise ValueError(f"min_bytes={min_bytes} must be >= 1 (default {MIN_BYTES}).")
        self.target = target
        self.min_bytes = min_bytes
        self.store = DiskStore(directory=directory, num_threads=num_threads) if target == "disk" else HostStore()
        self._last_group: _Group | None = None
        self.reset_stats()

    def _settings(self) -> tuple[str, str | None, int, int]:
        """What a new engine like this one is made from: target, directory, sizes."""
        directory = None if self.target != "disk" or self.store.root is None else str(self.store.root)
        num_threads = self.store.num_threads if self.target == "disk" else 2
        return self.target, directory, self.min_bytes, num_threads

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadEngine:
        """An engine of its own for a copy of a model with a plan applied (an EMA copy, a copy to
        evaluate): the same target, directory and sizes; no file, thread or lock shared (a deep
        copy raised "cannot pickle '_thread.lock' object")."""
        copied = _engine_like(*self._settings())
        memo[id(self)] = copied
        return copied

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled (``torch.save(model)`` of a model with a plan applied), an engine is its settings: the
        loaded model gets an engine of its own, as a deep copy does (it raised "cannot pickle
        '_thread.lock' object"); its directory is checked where the model is loaded."""
        return _engine_like, self._settings()

    def reset_stats(self) -> None:
        self._stats = {"offloaded_bytes": 0, "offloaded_storages": 0, "kept_tensors": 0, "restored_tensors": 0}

    def stats(self) -> OffloadStats:
        return OffloadStats(**self._stats)

    @contextmanager
    def block_context(self, block_name: str, module: nn.Module | None = None) -> Iterator[None]:
        """Offload what autograd saves while the body runs; ``module``'s params/buffers stay."""
        self.store.check()
        group = _Group(block_name, self._last_group, _module_storage_ptrs(module))
        self._last_group = group
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(group, t), self._unpack
            ):
                yield
            self.store.check()
        except BaseException:
            self.store.purge()
            raise
        finally:
            group.by_storage.clear()  # storages were pinned only to make data_ptr keys unique
            if group.file is not None:
                group.file.seal()
                group.file = None  # the tickets keep it alive for backward

    def _offloadable(self, group: _Group, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter:
            return False
        if t.layout != torch.strided or t.is_leaf and t.requires_grad:
            return False
        if t.device.type not in (("cuda",) if self.target == "cpu" else ("cpu", "cuda")):
            return False
        storage = t.untyped_storage()
        return storage.nbytes() >= self.min_bytes and storage.data_ptr() not in group.kept_ptrs

    def _pack(self, group: _Group, t: torch.Tensor) -> Any:
        if not self._offloadable(group, t):
            self._stats["kept_tensors"] += 1
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in group.by_storage:
            if group.file is None:
                group.file = self.store.open_block(group.name)
            data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            group.by_storage[ptr] = (group.file.put(data), data)
            self._stats["offloaded_bytes"] += storage.nbytes()
            self._stats["offloaded_storages"] += 1
        ticket = group.by_storage[ptr][0]
        group.tickets.add(ticket)
        return _Packed(group, ticket, t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        try:
            packed.group.prefetch()
            prev = packed.group.prev() if packed.group.prev is not None else None
            if prev is not None:
                prev.prefetch()
            data = packed.ticket.get()
        except BaseException:
            self.store.purge()
            raise
        self._stats["restored_tensors"] += 1
        if data.device != packed.device:
            data = data.to(packed.device, non_blocking=True)
        out = torch.empty(0, dtype=packed.dtype, device=packed.device)
        return out.set_(data.untyped_storage(), packed.offset, packed.size, packed.stride)

    def wait_writes(self) -> None:
        """Block until every pending transfer to the target has ended (tests, benchmarks)."""
        self.store.wait_writes()

    def close(self) -> None:
        """Delete every offloaded file / buffer and the private directory; stop the threads."""
        self._last_group = None
        self.store.close()
