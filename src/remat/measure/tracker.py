"""A device-agnostic tracker of live storages: the exact peak of a training step by category.

`LiveTracker` is a ``TorchDispatchMode``: every aten op's outputs whose storages are new
(not among its inputs' storages) are added with their storage bytes, and a
``weakref.finalize`` on the storage removes them when it is freed. Storages that existed
before the step are counted only when registered (parameters, buffers, gradients,
optimizer state); the batch and anything else the caller holds is not counted. Only
storages on the tracked device count. Allocations inside a kernel that never surface as a
tensor are invisible (on CUDA compare with ``torch.cuda.max_memory_allocated``).

Every tracked storage carries a label: ``parameters``, ``buffers``, ``gradients``,
``optimizer_state``, ``temporaries`` (new and not yet known to be anything else) or
``act:<segment>`` (saved for backward; category ``activations``). Labels move a storage
between categories: `tag` (saved tensors, gradients after accumulation, new optimizer state).

A *window* measures the peak of ``live - (live bytes of some labels)`` between two
moments; `remat.measure.profile` uses it for the backward temporaries of each block.

A storage key is an address, and the allocator hands a freed storage's address to the next
storage it makes: a window's pinned and apart storages are storages, not keys, so each leaves
its set as it is freed, and a later storage at its address counts as any other.

`track_step(step, model=..., optimizer=..., blocks=...)` runs a whole step under the
tracker and returns its peak, the categories at the peak and a block-boundary timeline.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from remat._batch import batch_tensors, model_device
from remat.measure.blocks import Blocks, find_blocks
from remat.measure.boundaries import Boundary, StepBoundaries
from remat.measure.saved import SavedAccountant
from remat.measure.storage import flat_tensors, plain_tensors, storage_key, storage_nbytes, tensors_in
from remat.measure.types import MemoryEvent

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
ACT_PREFIX = "act:"


def category_of(label: str) -> str:
    """The category a label counts in."""
    return "activations" if label.startswith(ACT_PREFIX) else label


@dataclass
class _Entry:
    nbytes: int
    label: str
    finalizer: weakref.finalize


_ACTIVE: list[LiveTracker] = []
"""Trackers entered and not yet exited: what `note_allocated` tells."""
_LOCK = threading.RLock()
"""Serializes the trackers' bookkeeping: storages are freed (finalizers) and noted
(`note_allocated`) on other threads than the step's."""


_STORAGE_RESIZE = torch.UntypedStorage.resize_
"""The storage method `_tracked_resize` stands in for while a tracker is active."""


def _tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` that tells the active trackers how many bytes it allocated or
    freed. FSDP2 gathers a unit's weights into storages it keeps and resizes (to their full size
    before the unit runs, to 0 after): no op makes a tensor there, so a dispatch mode alone
    never saw them, and an FSDP2 step's per-rank peak read 10 % low."""
    before = storage.nbytes()
    out = _STORAGE_RESIZE(storage, size)
    delta = storage.nbytes() - before
    if delta:
        with _LOCK:
            for tracker in list(_ACTIVE):
                tracker._resized(storage, delta)
    return out


def note_allocated(t: torch.Tensor, label: str = "temporaries") -> None:
    """Count ``t``'s storage in every active tracker: one another thread made for the step (a
    disk offload's read-back buffer), which a dispatch mode, seeing its own thread's ops only,
    does not see made."""
    with _LOCK:
        for tracker in list(_ACTIVE):
            tracker._add(t, label)


class LiveTracker(TorchDispatchMode):
    """Live storage bytes on one device, their running peak and the categories at the peak."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.live_by_label: dict[str, int] = {}
        self.peak_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._live_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._entries: dict[int, _Entry] = {}
        self._window: frozenset[str] | None = None
        self._window_excluded = 0
        self._window_peak = 0
        self._watch: str | None = None
        self._watch_freed: list[tuple[int, int]] = []
        self._pinned: set[int] = set()
        self._pinned_freed = 0
        self._window_pinned_peak = 0
        self._apart: set[int] = set()
        self._apart_live = 0
        self._window_apart_peak = 0

    # ---- registration and labels -------------------------------------------------------
    def register(self, tensors: Iterable[torch.Tensor], label: str) -> None:
        """Count the storages of existing tensors under ``label`` (ignored when already counted)."""
        for t in tensors:
            self._add(t, label)

    def tag(self, t: torch.Tensor, label: str, *, only_from: str = "temporaries") -> None:
        """Move the tensor's storage to ``label`` if it is counted under ``only_from``."""
        if is_traceable_wrapper_subclass(t):
            for inner in plain_tensors(t):
                self.tag(inner, label, only_from=only_from)
            return
        entry = self._entries.get(storage_key(t) if self._on_device(t) else None)
        if entry is None or entry.label != only_from:
            return
        self._shift(entry.label, -entry.nbytes)
        entry.label = label
        self._shift(label, entry.nbytes)
        if self.live_bytes == self.peak_bytes:  # still at the peak: reclassify it too
            self.peak_by_category = dict(self._live_by_category)

    def live_in(self, categories: Iterable[str]) -> int:
        """Live bytes now in ``categories`` (`CATEGORIES`)."""
        return sum(self._live_by_category[c] for c in categories)

    def live_keys(self) -> Any:
        """The `storage_key` of every storage tracked and live now (a set-like view)."""
        return self._entries.keys()

    def tracks(self, t: torch.Tensor) -> bool:
        """Whether the tensor's storage (a wrapper's: its inner tensors') is counted: made by an
        op since the tracker started, or registered. A storage from before (a table the model
        cached in an earlier step) is not; nor is one on another device."""
        return any(storage_key(p) in self._entries for p in plain_tensors(t))

    def label_of(self, t: torch.Tensor) -> str | None:
        """The label the tensor's storage is counted under, or None when not counted."""
        entry = self._entries.get(storage_key(t))
        return None if entry is None else entry.label

    # ---- windows ----------------------------------------------------------------------
    def open_window(self, excluded_labels: Iterable[str] = (), offset_bytes: int = 0,
                    watch_label: str | None = None, pinned: Iterable[int] = (), apart: Iterable[int] = ()) -> None:
        """Start measuring the peak of live bytes minus the bytes now under ``excluded_labels``
        minus a constant ``offset_bytes``; with ``watch_label``, also the order in which storages
        under that label are freed (`window_freed`); with ``pinned`` (storage keys), also the peak
        were those never freed (`pinned_peak`); with ``apart`` (storage keys), also the peak
        without those storages while they live (`apart_peak`)."""
        self._window = frozenset(excluded_labels)
        self._window_excluded = offset_bytes + sum(self.live_by_label.get(label, 0) for label in self._window)
        self._window_peak = self.live_bytes - self._window_excluded
        self._watch = watch_label
        self._watch_freed = []
        self._pinned, self._pinned_freed = {k for k in pinned if k in self._entries}, 0
        self._window_pinned_peak = self._window_peak
        self._apart = {k for k in apart if k in self._entries}
        self._apart_live = sum(self._entries[k].nbytes for k in self._apart)
        self._window_apart_peak = self._window_peak - self._apart_live

    def apart_peak(self) -> int:
        """The open window's peak without its ``apart`` storages while they live: what it peaks at
        where something counted apart holds them throughout."""
        return self._window_apart_peak

    def apart_keys(self) -> frozenset[int]:
        """The keys of the open window's ``apart`` storages still live: what a window opened after
        it sets apart of them. The keys it was opened with may name other storages by now (a
        freed storage's address comes back to the next one made)."""
        return frozenset(self._apart)

    def bytes_of_key(self, key: int) -> int:
        """Bytes of a tracked storage (0: not tracked)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.nbytes

    def pinned_peak(self) -> int:
        """The open window's peak had its pinned storages lived to its end."""
        return self._window_pinned_peak

    def label_of_key(self, key: int) -> str | None:
        """The label a tracked storage key is counted under (None: not tracked)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.label

    def window_value(self) -> int:
        """The open window's value now: live bytes less its excluded labels and offset."""
        return self.live_bytes - self._window_excluded

    def close_window(self) -> int:
        """End the window; its peak."""
        self._window = None
        self._pinned, self._apart, self._apart_live = set(), set(), 0
        return self._window_peak

    def window_freed(self) -> tuple[tuple[int, int], ...]:
        """Of the last window with a watched label: ``(storage key, bytes)`` of the storages freed
        under that label, in the order they were freed."""
        return tuple(self._watch_freed)

    # ---- dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in flat_tensors(args, kwargs)}
        for t in flat_tensors((out,)):
            if storage_key(t) not in inputs:
                self._add(t, "temporaries")
        return out

    def __enter__(self) -> LiveTracker:
        with _LOCK:
            _ACTIVE.append(self)
            torch.UntypedStorage.resize_ = _tracked_resize
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE:
                torch.UntypedStorage.resize_ = _STORAGE_RESIZE
            for entry in self._entries.values():
                entry.finalizer.detach()
            self._entries.clear()

    # ---- bookkeeping ------------------------------------------------------------------
    def _on_device(self, t: torch.Tensor | torch.UntypedStorage) -> bool:
        return t.device.type == self.device.type and (
            self.device.index is None or t.device.index in (None, self.device.index)
        )

    def _add(self, t: torch.Tensor, label: str) -> None:
        with _LOCK:
            self._add_locked(t, label)

    def _add_locked(self, t: torch.Tensor, label: str) -> None:
        if is_traceable_wrapper_subclass(t):  # DTensor (FSDP2): its local shard is what lives here
            for inner in plain_tensors(t):
                self._add(inner, label)
            return
        key = storage_key(t)
        if key is None or key in self._entries or not self._on_device(t):
            return
        nbytes = storage_nbytes(t)
        finalizer = weakref.finalize(t.untyped_storage(), self._free, key)
        self._entries[key] = _Entry(nbytes=nbytes, label=label, finalizer=finalizer)
        self._shift(label, nbytes)

    def _resized(self, storage: torch.UntypedStorage, delta: int) -> None:
        """A storage grew or shrank by ``delta`` bytes in place (`_tracked_resize`). One the
        tracker does not count yet is counted from when it grows (made before the step at size
        0, as FSDP2's gathered weights are); one it does not count that shrinks is not its own."""
        if not self._on_device(storage):
            return
        key = storage._cdata
        entry = self._entries.get(key)
        if entry is None:
            if delta <= 0:
                return
            finalizer = weakref.finalize(storage, self._free, key)
            entry = self._entries[key] = _Entry(nbytes=0, label="temporaries", finalizer=finalizer)
        delta = max(delta, -entry.nbytes)
        entry.nbytes += delta
        if key in self._apart:
            self._apart_live += delta
        self._shift(entry.label, delta)

    def _free(self, key: int) -> None:
        with _LOCK:
            entry = self._entries.pop(key, None)
            if entry is not None:
                if self._window is not None and entry.label == self._watch:
                    self._watch_freed.append((key, entry.nbytes))
                # the pinned or apart storage is gone: the next storage at its address is not it
                if self._window is not None and key in self._pinned:
                    self._pinned.discard(key)
                    self._pinned_freed += entry.nbytes
                if key in self._apart:
                    self._apart.discard(key)
                    self._apart_live -= entry.nbytes
                self._shift(entry.label, -entry.nbytes)

    def _shift(self, label: str, delta: int) -> None:
        self.live_by_label[label] = self.live_by_label.get(label, 0) + delta
        self._live_by_category[category_of(label)] += delta
        self.live_bytes += delta
        if self._window is not None:
            if label in self._window:
                self._window_excluded += delta
            value = self.live_bytes - self._window_excluded
            self._window_peak = max(self._window_peak, value)
            self._window_pinned_peak = max(self._window_pinned_peak, value + self._pinned_freed)
            self._window_apart_peak = max(self._window_apart_peak, value - self._apart_live)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_category = dict(self._live_by_category)


# ---- a whole step ---------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class TrackedStep:
    """What `track_step` measured."""

    peak_bytes: int
    """Peak live tracked bytes during the step (model state + everything the step allocated)."""
    peak_bytes_by_category: dict[str, int]
    """The categories of `CATEGORIES` at the peak; they sum to ``peak_bytes``."""
    timeline: tuple[MemoryEvent, ...]
    """Live bytes at each block boundary and around the optimizer step."""
    device_max_allocated_bytes: int | None
    """``torch.cuda.max_memory_allocated`` during the step (CUDA only; includes the batch)."""
    result: Any = None
    """What the step function returned."""


class StepTracking:
    """Context manager wiring a `LiveTracker` to a model: labels for every category, timeline.

    Inside it, saved tensors are labelled ``act:<segment>`` (see `remat.measure.saved`),
    gradients ``gradients`` once accumulated, optimizer state ``optimizer_state`` after each
    step. ``listeners`` receive every `Boundary` after the timeline has recorded it.
    """

    def __init__(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
                 blocks: Blocks = (), batch: Any = None, listeners: Iterable[Callable] = ()) -> None:
        self.model = model
        self.optimizer = optimizer
        self.tracker = LiveTracker(model_device(model))
        self.timeline: list[MemoryEvent] = []
        excluded = [*model.parameters(), *model.buffers(), *batch_tensors(batch)]
        self.accountant = SavedAccountant(list(blocks), exclude=excluded, on_saved=self._on_saved,
                                          made_in_step=self.tracker.tracks)
        self.boundaries = StepBoundaries(list(blocks), optimizer, [self._on_boundary, *listeners])
        self._handles: list = []

    def __enter__(self) -> StepTracking:
        self._register_state()
        for p in self.model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(self._on_step))
        self.accountant.__enter__()
        self.boundaries.__enter__()
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracker.__exit__(*exc)
        self.boundaries.__exit__(*exc)
        self.accountant.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # the callbacks are bound methods of this object: a cycle that kept the model (a verified copy)
        # alive until the garbage collector ran, however many copies a run of `verify` calls made
        self.accountant._on_saved = None
        self.boundaries.listeners.remove(self._on_boundary)

    def _register_state(self) -> None:
        register_state(self.tracker, self.model, self.optimizer)

    def _on_saved(self, t: torch.Tensor, nbytes: int, segment: str) -> None:
        self.tracker.tag(t, ACT_PREFIX + segment)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.tracker.tag(p.grad, "gradients")
            self.tracker.register([p.grad], "gradients")

    def _on_step(self, *_: object) -> None:
        for t in optimizer_state_tensors(self.optimizer):
            self.tracker.tag(t, "optimizer_state")
            self.tracker.register([t], "optimizer_state")

    def _on_boundary(self, event: Boundary) -> None:
        phase = event.kind.split("_", 1)[0]
        if phase in ("fwd", "bwd", "opt"):
            self.timeline.append(MemoryEvent(phase=phase, where=event.where, live_bytes=self.tracker.live_bytes))


def register_state(tracker: LiveTracker, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Count what a step starts from: parameters, buffers, gradients, optimizer state."""
    params = list(model.parameters())
    tracker.register(params, "parameters")
    tracker.register(model.buffers(), "buffers")
    tracker.register((p.grad for p in params if p.grad is not None), "gradients")
    tracker.register(optimizer_state_tensors(optimizer), "optimizer_state")


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """The bytes on ``device`` a step starts from as `track_step` counts them (`register_state`)."""
    tracker = LiveTracker(device)
    register_state(tracker, model, optimizer)
    return tracker.live_bytes


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors, without 0-dim step counters. An optimizer
    that wraps others and keeps no state of its own, its state dict laid out its own way, has
    the tensors of its state dict (those of the optimizers it wraps)."""
    if optimizer is None:
        return []
    found = [
        value for state in optimizer.state.values() for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    if found or type(optimizer).state_dict is torch.optim.Optimizer.state_dict:
        return found
    return [t for t in tensors_in(optimizer.state_dict()) if t.dim() > 0]


def track_step(step: Callable[[], Any], *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               blocks: Blocks | str | Iterable[str] | None = None, batch: Any = None) -> TrackedStep:
    """Run ``step()`` (forward, backward, optimizer step...) under the live-storage tracker.

    ``blocks``: the block list of `find_blocks`, patterns for it, or None to detect them
    (no blocks, hence no block events in the timeline, when none are found). ``batch``: its
    tensors are never counted as activations.
    """
    block_list = _resolve_blocks(model, blocks)
    device = model_device(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with StepTracking(model, optimizer=optimizer, blocks=block_list, batch=batch) as tracking:
        result = step()
    device_max = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    tracker = tracking.tracker
    return TrackedStep(
        peak_bytes=tracker.peak_bytes, peak_bytes_by_category=dict(tracker.peak_by_category),
        timeline=tuple(tracking.timeline), device_max_allocated_bytes=device_max, result=result,
    )


def _resolve_blocks(model: nn.Module, blocks: Any) -> Blocks:
    if blocks is None:
        try:
            return find_blocks(model)
        except ValueError:
            return []
    if isinstance(blocks, str) or all(isinstance(b, str) for b in blocks):
        return find_blocks(model, blocks)
    return list(blocks)


# ---- the allocator's view ---------------------------------------------------------------


MEASURED_STEP = "remat::measured_step"
"""The profiler's label of the step `allocator_net_peak_bytes` measures."""


def allocator_net_peak_bytes(step: Callable[[], Any], device: torch.device,
                             before: Callable[[], Any] | None = None) -> int:
    """The highest the bytes the allocator handed out on ``device`` rose above those out when
    ``step()`` began (its allocation and free events, recorded by ``torch.profiler`` with
    ``profile_memory=True``). It sees the buffers of compiled kernels, which never surface to the
    tracker as tensors: a compiled step's peak is the tracker's peak of the step run eagerly plus
    the difference of the two net peaks, both measured from the same state.

    ``before``: run first, under the same recording but not measured. The allocator reports a free
    only with the size it recorded at the allocation, so a step that frees what a step before it
    made (the last step's gradients, under ``zero_grad(set_to_none=True)``) is measured after one
    such step recorded too; a free of memory allocated before the recording is not seen."""
    return max((peak for _, _, peak in allocator_timeline(step, device, before)), default=0)


MARK = "remat::mark:"
"""The profiler's label prefix of an `allocator_mark`."""


def allocator_mark(name: str) -> None:
    """Marks the allocator's timeline that `allocator_timeline` reads (an empty profiler range)."""
    from torch.autograd.profiler import record_function

    with record_function(MARK + name):
        pass


def allocator_timeline(step: Callable[[], Any], device: torch.device,
                       before: Callable[[], Any] | None = None) -> list[tuple[str, int, int]]:
    """The allocator's net bytes on ``device`` through ``step()`` (as `allocator_net_peak_bytes`
    measures them: above those out when it began; ``before`` likewise), at each `allocator_mark`
    it made, in order: ``(name, bytes at the mark, the highest they rose since the mark before)``,
    and last ``("", bytes at the end, the highest since the last mark)``."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        if before is not None:
            before()
        with record_function(MEASURED_STEP):
            step()
    events = list(prof.profiler.kineto_results.events())
    marks = [e for e in events if e.name() == MEASURED_STEP]
    begin = min(e.start_ns() for e in marks)
    end = max(e.start_ns() + e.duration_ns() for e in marks)
    memory = [(e.start_ns(), e.nbytes()) for e in events
              if e.name() == "[memory]" and e.device_type().name.lower() == device.type
              and (device.index is None or e.device_index() in (device.index, -1))]
    named = [(e.start_ns(), e.name()[len(MARK):]) for e in events
             if e.name().startswith(MARK) and begin <= e.start_ns() <= end]
    timeline: list[tuple[str, int, int]] = []
    live = start = 0
    peak = None
    points = sorted([(t, 0, "", n) for t, n in memory] + [(t, 1, name, 0) for t, name in named],
                    key=lambda point: point[:2])  # stable: events at one time in the profiler's order
    for t, is_mark, name, nbytes in points:
        if t >= begin and peak is None:
            start = peak = live
        if t > end:
            break
        if is_mark:
            timeline.append((name, live - start, peak - start))
            peak = live
            continue
        live += nbytes
        if peak is not None:
            peak = max(peak, live)
    if peak is None:
        return [("", 0, 0)]
    return [*timeline, ("", live - start, peak - start)]
