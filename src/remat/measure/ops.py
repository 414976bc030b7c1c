"""The op table of each block: every aten op call of its forward, in call order.

`OpRecorder` is a ``TorchDispatchMode`` active during a forward. Each call gets the key
``"<op>#<n>"``, n counting calls of that op within the segment (the same key the selective
policy uses), the bytes of the new storages it allocated for its outputs (storages not among
its inputs': views and in-place ops allocate none), its FLOPs (`remat.measure.flops`), its
wall time, and flags: random (the op carries the ``nondeterministic_seeded`` tag: dropout,
bernoulli, rand*) and view (the overload is declared a view), and the block-local ids of the
storages its outputs live in (numbered in allocation order within the segment; a view or an
in-place op names its source's id), so a plan that caches an op's output can be priced by the
distinct storages it keeps alive, and which of them outlive the block anyway (a later block
reads them, or a later segment saves them first). A call is marked ``mutated_later`` when a later
call of the forward writes into a storage its outputs live in (an argument the op's schema
declares written: ``add_``'s self, an ``out=``), which selective checkpointing cannot cache
(`remat.checkpointing.cacheable`). After the forward,
`OpRecorder.records` maps each saved storage back to the op that produced it, so an op's
``saved_bytes`` are the bytes of its outputs that autograd saved (first saver's segment only).
Ops that run during backward are not recorded.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.checkpointing.cacheable import is_in_place
from remat.measure.boundaries import in_backward
from remat.measure.flops import op_flops
from remat.measure.saved import BETWEEN, POST, SavedStorage
from remat.measure.sharing import args_signature
from remat.measure.storage import flat_tensors, storage_key, storage_nbytes, storage_of
from remat.measure.types import OpRecord


@dataclass
class _Call:
    name: str
    key: str
    new_storages: dict[int, int]
    flops: int
    is_random: bool
    is_view: bool
    storage_ids: tuple[int, ...] = ()
    storage_bytes: tuple[int, ...] = ()
    times_s: list[float] = field(default_factory=list)
    live_after: int = 0
    """``live_bytes()`` once the call's outputs exist (0 without a ``live_bytes``)."""
    mutated_later: bool = False
    """A later call of the forward wrote into a storage of its outputs."""
    args: tuple[Any, ...] = ()
    """`remat.measure.sharing.args_signature` of its arguments (shapes, dtypes, other values)."""


class OpRecorder(TorchDispatchMode):
    """Records the forward op calls per segment (``segment_of()`` names the running segment).

    ``sync`` is called before each clock read (``torch.cuda.synchronize`` on CUDA). Run the
    same forward several times under one recorder to get a median time per call; the calls
    of every run after the first must match the first run's keys.
    """

    def __init__(self, segment_of: Callable[[], str], sync: Callable[[], None] | None = None,
                 live_bytes: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.segment_of = segment_of
        self.live_bytes = live_bytes
        """Bytes live on the device (the accounting step's tracker), read at each call of the
        first run: the forward's live curve (`remat.measure.types.BlockProfile.fwd_live_bytes`)."""
        self.enabled = True
        self._sync = sync
        self.calls: dict[str, list[_Call]] = defaultdict(list)
        self._producer: dict[int, tuple[str, int]] = {}
        self._made: dict[int, weakref.ref] = {}
        """Storage key -> the storage a call of the first run made there (weakly): a key is an
        address, which the allocator hands on once the storage is freed, so what `_producer`
        and `_storage_ids` say of a key holds of a live tensor's storage only while that storage
        lives (`_made_live`)."""
        self._counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._index: dict[str, dict[str, int]] = defaultdict(dict)
        self._storage_ids: dict[int, tuple[str, int]] = {}
        self._num_storages: dict[str, int] = defaultdict(int)
        self._escaped: dict[tuple[str, int], set[str]] = {}
        """(segment, storage number) -> the other segments that save that storage of its calls."""
        self.segment_order: Callable[[str], int] = lambda segment: -1
        """Where a segment's backward stands among the blocks': a block's index, the code between the
        block before k and block k counted as k (its backward runs right after k's), the post part as
        the number of blocks; -1 for the part before the blocks (`remat.measure.profile` sets it)."""
        self._holders: dict[int, list[_Call]] = {}
        """Storage key -> the calls whose outputs live in it, while it lives (`_note_writes`)."""
        self._first_run = True
        self.timed_segments: set[str] | None = None
        """The segments whose calls runs after the first time (None: all of them; blocks that take
        another block's timing are left out, `remat.measure.sharing`)."""
        self.own_generators: dict[str, list[str]] = defaultdict(list)
        """Segment -> keys of its random calls (first run) that drew from a ``torch.Generator`` of
        their own, not a device's default one (`own_generator`)."""
        self._varied: set[str] = set()
        self.readers: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        """Producing segment -> storage key -> the other segments whose calls (not views) read
        the storage while that segment's call was its last maker (first run)."""
        self.stop_calls: dict[str, int] = {}
        """Segment -> calls it had dispatched when autograd last saved a tensor in it (first
        run; `note_pack`)."""

    def note_pack(self, segment: str) -> None:
        """Autograd saved a tensor while ``segment`` ran: torch's early-stopping replay
        (``early_stop=True``) stops at its last save, so the calls dispatched by then are what it
        replays. An input saved before its op runs (autograd saves inputs before dispatching)
        leaves that op out, as the replay does."""
        if self._first_run and self.enabled and not in_backward():
            self.stop_calls[segment] = len(self.calls[segment])

    def producer_of(self, key: int) -> str | None:
        """The segment whose op call last made the storage ``key`` in the first run (None: made
        before it, or outside the recorded forward)."""
        found = self._producer.get(key) if self._made_live(key) else None
        return None if found is None else found[0]

    def storage_number_of(self, key: int) -> int:
        """The number of the storage ``key`` among its producing segment's call outputs
        (`remat.measure.types.OpRecord.storage_ids`; -1: not made by a recorded call, or gone)."""
        found = self._storage_ids.get(key) if self._made_live(key) else None
        return -1 if found is None else found[1]

    def _made_live(self, key: int | None) -> bool:
        """Whether the storage a recorded call made at ``key`` still lives: asked of a live
        tensor's storage key, whether the call made that storage. Else it is one made where no
        recorded call runs (``torch.tensor`` lifts its constant made outside the dispatch) at the
        address of one freed before: a lifted empty constant of DiffusionGemma's took the id of
        one of four storages of its block, or none, as the allocator gave addresses back."""
        ref = self._made.get(key)
        return ref is not None and ref() is not None

    def _stale(self, key: int | None) -> bool:
        """Whether the storage a recorded call made at ``key`` is freed: what was noted of the
        key was of that storage, not of the live tensor asked about."""
        ref = self._made.get(key)
        return ref is not None and ref() is None

    def next_run(self) -> None:
        """Start another run of the same forward (its times add to the first run's calls)."""
        self._note_varied()
        self._first_run = False
        self._counts.clear()

    def varied_segments(self) -> set[str]:
        """Segments whose calls in a later run were not the first run's: a call it did not make,
        or fewer or more of them (control flow on the data or on a random draw)."""
        self._note_varied()
        return set(self._varied)

    def _note_varied(self) -> None:
        if self._first_run:
            return
        for segment, counts in self._counts.items():
            if sum(counts.values()) not in (0, len(self.calls.get(segment, []))):
                self._varied.add(segment)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if in_backward() or not self.enabled or not self._timed(self.segment_of()):
            return func(*args, **kwargs)
        if self._sync is not None:
            self._sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self._sync is not None:
            self._sync()
        elapsed = time.perf_counter() - start
        self._record(func, args, kwargs, out, elapsed)
        return out

    def _timed(self, segment: str) -> bool:
        return self._first_run or self.timed_segments is None or segment in self.timed_segments

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any, elapsed_s: float) -> None:
        segment, name = self.segment_of(), str(func)
        occurrence = self._counts[segment][name]
        self._counts[segment][name] += 1
        calls, key = self.calls[segment], f"{name}#{occurrence}"
        if not self._first_run:
            index = self._index[segment].get(key)
            if index is not None:
                calls[index].times_s.append(elapsed_s)
            if index is None or calls[index].args != args_signature(args, kwargs):  # another op, or other shapes
                self._varied.add(segment)
            return
        self._index[segment][key] = len(calls)
        is_random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        if is_random and own_generator(args, kwargs):
            self.own_generators[segment].append(key)
        is_view = bool(getattr(func, "is_view", False)) or _aliases(name, args, kwargs, out)
        if not is_view:
            self._note_reads(segment, args, kwargs)
        self._note_writes(func, args, kwargs)
        new = new_storages(args, kwargs, out)
        for storage in new:
            self._producer[storage] = (segment, len(calls))
        for t in flat_tensors((out,)):
            if storage_key(t) in new:
                self._made[storage_key(t)] = weakref.ref(storage_of(t))
        ids, nbytes = self._output_storages(segment, new, out)
        calls.append(_Call(
            name=name, key=key, new_storages=new, flops=op_flops(func, args, kwargs, out),
            is_random=is_random,
            is_view=is_view,
            storage_ids=ids, storage_bytes=nbytes,
            times_s=[elapsed_s], args=args_signature(args, kwargs),
            # the tracker is the outer mode: it adds this call's outputs after the call returns
            live_after=self.live_bytes() + sum(new.values()) if self.live_bytes is not None else 0,
        ))
        self._hold(calls[-1], new, out)

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Mark every earlier call whose outputs live in a storage this call writes into."""
        for t in written_tensors(func, args, kwargs):
            key = storage_key(t)
            for call in self._holders.get(key, ()) if not self._stale(key) else ():
                call.mutated_later = True

    def _hold(self, call: _Call, new: dict[int, int], out: Any) -> None:
        """Remember that ``call``'s outputs live in their storages (a new storage starts a new
        list: a freed storage's key may come back)."""
        for key in new:
            self._holders[key] = []
        for key in {storage_key(t) for t in flat_tensors((out,))} - {None}:
            if self._stale(key):  # an unrecorded storage at a freed one's address
                self._holders[key] = []
            self._holders.setdefault(key, []).append(call)

    def _output_storages(self, segment: str, new: dict[int, int], out: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Block-local ids and bytes of the storages behind ``out``: a new storage gets the next id
        of ``segment`` (a freed storage's address may come back, so new always wins); an old one
        keeps its id when ``segment`` allocated it and is left out otherwise."""
        for key in new:
            self._storage_ids[key] = (segment, self._num_storages[segment])
            self._num_storages[segment] += 1
        found: dict[int, int] = {}
        for t in flat_tensors((out,)):
            key = storage_key(t)
            owner = self._storage_ids.get(key) if key in new or self._made_live(key) else None
            if owner is not None and owner[0] == segment:
                found.setdefault(owner[1], storage_nbytes(t))
        return tuple(found), tuple(found.values())

    def storage_id(self, key: int, segment: str) -> int:
        """The id ``segment`` gave the storage with this key (`OpRecord.storage_ids`), -1 when
        another segment (or nothing recorded) allocated it."""
        owner = self._storage_ids.get(key)
        return owner[1] if owner is not None and owner[0] == segment else -1

    def _note_reads(self, segment: str, args: tuple, kwargs: dict) -> None:
        for t in flat_tensors(args, kwargs):
            key = storage_key(t)
            producer = self._producer.get(key) if self._made_live(key) else None
            if producer is not None and producer[0] != segment:
                self.readers[producer[0]][key].add(segment)

    def read_by_others(self, segment: str, keys: set[int], allowed: set[str]) -> set[str]:
        """The segments but ``segment`` and ``allowed`` whose calls (not views) read one of
        ``keys``, storages ``segment`` made (first run)."""
        made = self.readers.get(segment, {})
        return {reader for key in keys for reader in made.get(key, ())} - allowed - {segment}

    def segment_flops(self, segment: str) -> int:
        """Forward FLOPs of every recorded call of ``segment``."""
        return sum(call.flops for call in self.calls.get(segment, []))

    def saved_by_call(self, saved: Mapping[int, SavedStorage],
                      savers: Mapping[int, Sequence[str]] | None = None) -> dict[tuple[str, int], int]:
        """Saved bytes per ``(segment, call index)``; ``saved`` is `SavedAccountant.saved` of the
        same forward (``savers``: `SavedAccountant.savers`, every segment that saved each storage).
        A storage counts for its producer only when saved in the producer's segment; one another
        segment saves too outlives its block (noted for `records`): that
        segment's saved bytes hold it (kept) or its checkpoint, whose input it is. A storage later
        blocks only read (T5's position bias, which each layer adds to its scores) is not so: a
        kept reader lets it go after its forward, and a selective cache of it is what holds it."""
        totals: dict[tuple[str, int], int] = defaultdict(int)
        for key, record in saved.items():
            owner = self._storage_ids.get(key)
            others = {who for who in (savers or {}).get(key, (record.segment,)) if who != owner[0]} if owner else set()
            if others:
                self._escaped.setdefault(owner, set()).update(others)
            producer = self._producer.get(key)
            if producer is not None and producer[0] == record.segment:
                totals[producer] += record.nbytes
        return totals

    def _saved_from(self, segment: str, storage: int) -> int:
        """The first segment after ``segment`` in backward's reckoning (`segment_order`) that saves
        this storage of its calls too (-1: none does)."""
        here = self.segment_order(segment)
        later = [k for k in map(self.segment_order, self._escaped.get((segment, storage), ())) if k > here]
        return min(later, default=-1)

    def call_args(self, segment: str) -> tuple[tuple[Any, ...], ...]:
        """Per recorded call of ``segment``, `remat.measure.sharing.args_signature` of its arguments."""
        return tuple(call.args for call in self.calls.get(segment, []))

    def records(self, segment: str, saved_by_call: Mapping[tuple[str, int], int]) -> tuple[OpRecord, ...]:
        """The op table of ``segment`` (``saved_by_call`` from `saved_by_call`)."""
        return tuple(
            OpRecord(
                key=call.key, name=call.name, output_bytes=sum(call.new_storages.values()),
                saved_bytes=saved_by_call.get((segment, i), 0), time_ms=1e3 * statistics.median(call.times_s),
                flops=call.flops, is_random=call.is_random, is_view=call.is_view,
                storage_ids=call.storage_ids, storage_bytes=call.storage_bytes,
                storage_escapes=tuple((segment, s) in self._escaped for s in call.storage_ids),
                storage_saved_from=tuple(self._saved_from(segment, s) for s in call.storage_ids),
                mutated_later=call.mutated_later,
            )
            for i, call in enumerate(self.calls.get(segment, []))
        )


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments that its op's schema declares written in place."""
    found = []
    for position, argument in enumerate(_schema_arguments(func)):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or position >= len(args) else args[position]
        found += flat_tensors((value,))
    return found


def _schema_arguments(func: Any) -> list[Any]:
    schema = getattr(func, "_schema", None)
    return list(schema.arguments) if schema is not None else []


def new_storages(args: tuple, kwargs: dict, out: Any) -> dict[int, int]:
    """Storage key -> bytes of the storages behind ``out`` that none of the inputs has."""
    inputs = {storage_key(t) for t in flat_tensors(args, kwargs)}
    new: dict[int, int] = {}
    for t in flat_tensors((out,)):
        key = storage_key(t)
        if key is not None and key not in inputs:
            new[key] = storage_nbytes(t)
    return new


def own_generator(args: tuple, kwargs: dict) -> bool:
    """Whether a call draws from a ``torch.Generator`` passed to it that is no device's default
    generator (``torch.rand(..., generator=g)``). Checkpointing saves and restores the default
    generators' states around a replay, never such a one: the replay draws the next numbers."""
    defaults = {torch.default_generator._cdata}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        defaults.update(g._cdata for g in torch.cuda.default_generators)
    values = (*args, *kwargs.values())
    return any(isinstance(v, torch.Generator) and v._cdata not in defaults for v in values)


def _aliases(name: str, args: tuple, kwargs: dict, out: Any) -> bool:
    """Whether a call that is not in place returns only tensors in its inputs' storages: an
    alias torch does not tag as a view (``aten._unsafe_view`` after a matmul's reshape). Saving
    it keeps its input's storage, which the call that made it saves as well; and under
    ``torch.compile`` it is traced as ``view``, so a key naming it would name another call."""
    if is_in_place(name):
        return False
    outputs = {storage_key(t) for t in flat_tensors((out,))}
    return bool(outputs) and None not in outputs and outputs <= {storage_key(t) for t in flat_tensors(args, kwargs)}
