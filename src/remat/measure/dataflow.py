"""Dataflow between blocks: where each block's inputs come from, and who holds which storage.

`DataflowRecorder` watches the accounting step's forward: at each block's call, every tensor
argument (positional and keyword; Hugging Face passes most by keyword) with its storage, its
bytes and the segment that made it (`remat.measure.ops.OpRecorder.producer_of`); at the end of
the forward, every segment that saved each storage (`remat.measure.saved.SavedAccountant.savers`).
Storages are told apart by identity (a weak reference to the storage object), so an address
reused after a free is a new storage.

From that, `BlockFlow` per block (the terms `remat.plan.costs` prices; segments in run order:
``pre``, block 0, the code between blocks 0 and 1, block 1, ..., ``post``):

- an input storage that an earlier segment saved, or an earlier block took, is counted there
  (a mask or rotary table passed to every layer counts once, not once per layer);
- of the rest, one that later blocks take too and this block does not save (a mask: no op
  saves it) is *shared*: held from this block on whenever a checkpoint of a block taking it
  holds it, so counted from here on in every plan (`BlockProfile.shared_entry_bytes`);
- the others are *held* by a checkpoint of this block (``held_input_bytes``), and beside its
  replay when it does not save them itself (``unsaved_input_bytes``);
- a storage this block saves first (not one of its inputs) that something after it holds too
  (the next block saves its output again; a pooling after it saves it; a later block takes it:
  a skip connection) is *handed off*: it outlives a checkpoint of this block, so it is counted
  from the next block's entry on (``handoff_bytes``; ``handoff_next_bytes``: held by the next
  block alone);
- an output this block saves first that the model's code still holds when the next block's
  forward begins (``x = up(F.interpolate(x), skip)`` holds ``x`` through the call), not handed
  off nor taken by the next block, is live in that forward whatever this block's strategy
  (``output_held_bytes``). It is seen by a weak reference to the output tensor object: autograd
  keeps an op's saved output by its data, not by that object, so the object is alive only while
  the code holds it (an output some op saved as its input keeps the object alive: counted, an
  upper bound).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.checkpointing.caches import cache_tensors, is_kv_cache
from remat.measure.blocks import Blocks
from remat.measure.boundaries import in_backward
from remat.measure.saved import BETWEEN, POST, PRE, SavedStorage, between_name
from remat.measure.storage import storage_key, storage_nbytes, storage_of
from remat.measure.types import BlockInput

__all__ = ["DataflowRecorder", "BlockFlow", "block_flows", "segment_position", "named_tensors"]


CACHE_MARK = "<cache>"
"""In `named_tensors`' names, what marks a tensor a key/value cache argument holds."""


MAP_MARK = "<map>"
"""In `named_tensors`' names, what marks a tensor a mapping argument holds."""


def named_tensors(args: tuple[Any, ...], kwargs: dict[str, Any], mappings: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The tensor arguments of a call with their names: ``args[i]``, the keyword, and an index
    per level for tensors inside tuples and lists (``position_embeddings[0]``) and Hugging Face
    key/value caches (``past_key_values<cache>[0]``: the keys and values a cache holds as the
    block is called, prefix tuning's virtual tokens, which a checkpoint of the block holds for its
    replay, `remat.checkpointing.region`); with ``mappings``, the values of dicts too
    (``attention_mask<map>['causal']``: ZAYA hands each layer its masks in a dict, which a
    checkpoint of the layer holds for its replay)."""
    out: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(args):
        _collect(f"args[{i}]", value, out, mappings)
    for key, value in kwargs.items():
        _collect(key, value, out, mappings)
    return out


def _collect(name: str, value: Any, out: list[tuple[str, torch.Tensor]], mappings: bool = False) -> None:
    # a module-level function, not a closure: a recursive closure is a reference cycle that
    # would keep the block's inputs alive until the garbage collector runs
    if isinstance(value, torch.Tensor):
        out.append((name, value))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _collect(f"{name}[{i}]", item, out, mappings)
    elif is_kv_cache(value):
        for i, item in enumerate(cache_tensors(value)):
            out.append((f"{name}{CACHE_MARK}[{i}]", item))
    elif mappings and isinstance(value, dict):
        for key, item in value.items():
            _collect(f"{name}{MAP_MARK}[{key!r}]", item, out, mappings)


@dataclass
class _Arg:
    argument: str
    storage: int
    storage_bytes: int
    activation: bool
    producer: str | None
    number: int = -1


@dataclass
class _Storage:
    ref: weakref.ref
    key: int
    savers: tuple[str, ...] = ()


class DataflowRecorder:
    """Context manager: the tensor arguments of every block call of one forward, by storage.

    ``producer_of(key)`` names the segment whose op made the storage (None: made before the
    step); ``excluded``: storage keys of the batch, parameters and buffers (not activations);
    call `finish` with the accountant's savers once the forward has ended."""

    def __init__(self, blocks: Blocks, producer_of: Callable[[int], str | None], excluded: Iterable[int],
                 number_of: Callable[[int], int] | None = None) -> None:
        self.blocks = blocks
        self.producer_of = producer_of
        self.number_of = number_of
        self.excluded = set(excluded)
        self.args: list[list[_Arg]] = [[] for _ in blocks]
        self.outputs: list[list[tuple[weakref.ref, int, int]]] = [[] for _ in blocks]
        """Per block: its output tensors (weakly), their storage keys and bytes."""
        self.held_outputs: list[dict[int, int]] = [{} for _ in blocks]
        """Per block: storage key -> bytes of its outputs alive when the next block began, not
        among that block's inputs."""
        self.storages: list[_Storage] = []
        self.live_inputs: list[list[tuple[int, int]]] = [[] for _ in blocks]
        """Per block: ``(earlier block, storage id)`` of the earlier blocks' arguments alive when it
        began, not among its own."""
        self.alive_at: list[set[int]] = [set() for _ in blocks]
        """Per block: ids of the storages of its and the earlier blocks' arguments alive as it began."""
        self._pending: dict[int, int] = {}  # storage id -> the first block that took it (the one that may hold it)
        self._block_names = {name for name, _ in blocks}
        self._by_key: dict[int, int] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> DataflowRecorder:
        for index, (_, module) in enumerate(self.blocks):
            self._handles.append(module.register_forward_pre_hook(self._hook(index), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._output_hook(index)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if in_backward() or self.args[index]:
                return
            tensors = named_tensors(args, kwargs, mappings=True)
            own = {storage_key(t) for _, t in tensors}
            if index:
                self._held_outputs(index - 1, own)
            self._pending = {sid: j for sid, j in self._pending.items() if self.storages[sid].ref() is not None}
            self.live_inputs[index] = [(j, sid) for sid, j in self._pending.items() if self.storages[sid].key not in own]
            for name, tensor in tensors:
                key = storage_key(tensor)
                if key is not None and (CACHE_MARK in name or MAP_MARK in name) and self.producer_of(key) in self._block_names:
                    continue  # an earlier block's keys in a cache or a mapping: held with it (`remat.measure.held`)
                if key is not None:
                    self.args[index].append(_Arg(argument=name, storage=self._storage_id(tensor, key),
                                                 storage_bytes=storage_nbytes(tensor), activation=key not in self.excluded,
                                                 producer=self.producer_of(key),
                                                 number=self.number_of(key) if self.number_of is not None else -1))
                    if self.args[index][-1].activation:
                        self._pending.setdefault(self.args[index][-1].storage, index)
            self.alive_at[index] = set(self._pending)

        return hook

    def _output_hook(self, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if in_backward() or self.outputs[index]:
                return
            self.outputs[index] = [(weakref.ref(t), storage_key(t), storage_nbytes(t))
                                   for _, t in named_tensors((output,), {}) if storage_key(t) is not None]

        return hook

    def _held_outputs(self, index: int, next_inputs: set[int | None]) -> None:
        for ref, key, nbytes in self.outputs[index]:
            if ref() is not None and key not in next_inputs:
                self.held_outputs[index][key] = nbytes

    def _storage_id(self, tensor: torch.Tensor, key: int) -> int:
        known = self._by_key.get(key)
        storage = storage_of(tensor)
        if known is not None and self.storages[known].ref() is storage:
            return known
        self._by_key[key] = len(self.storages)
        self.storages.append(_Storage(ref=weakref.ref(storage), key=key))
        return len(self.storages) - 1

    def finish(self, savers: dict[int, list[str]]) -> None:
        """Record who saved each storage still alive (a storage freed during the forward was
        saved by nobody)."""
        for record in self.storages:
            if record.ref() is not None:
                record.savers = tuple(savers.get(record.key, ()))

    def live_arguments(self) -> dict[int, int]:
        """Storage key -> id of the blocks' activation arguments whose storages are alive now."""
        out: dict[int, int] = {}
        for args in self.args:
            for arg in args:
                record = self.storages[arg.storage]
                if arg.activation and record.ref() is not None:
                    out[record.key] = arg.storage
        return out

    def key_ids(self) -> dict[int, int]:
        """Storage key -> id, for the storages alive when `finish` ran (saved ones among them)."""
        return {r.key: i for i, r in enumerate(self.storages) if r.savers}


def segment_position(segment: str, index_of: dict[str, int]) -> int:
    """Run-order position of a segment (``index_of``: block name -> index): pre 0, block i 2i+1,
    the code before block i 2i, post 2N."""
    if segment == PRE:
        return 0
    if segment == POST:
        return 2 * len(index_of)
    if segment.startswith(BETWEEN):
        return 2 * int(segment[len(BETWEEN):])
    return 2 * index_of[segment] + 1


@dataclass
class BlockFlow:
    """What the dataflow says about one block (fields of `remat.measure.types.BlockProfile`)."""

    inputs: tuple[BlockInput, ...] = ()
    held_input_bytes: int = 0
    unsaved_input_bytes: int = 0
    shared_entry_bytes: int = 0
    handoff_bytes: int = 0
    handoff_next_bytes: int = 0
    between_saved_bytes: int = 0
    entry_bytes: int = 0
    output_held_bytes: int = 0
    code_held_inputs: tuple[tuple[int, int], ...] = ()
    input_saved_after_bytes: int = 0
    input_saved_after_from: int = 0
    shared_freed: tuple[tuple[int, int], ...] = ()
    shared_saved: tuple[tuple[int, int, int], ...] = ()


def block_flows(recorder: DataflowRecorder, saved: dict[int, SavedStorage], savers: dict[int, list[str]],
                saved_by_segment: dict[str, int]) -> list[BlockFlow]:
    """Per block, its inputs with their sources and the byte terms of the module docstring."""
    names = [name for name, _ in recorder.blocks]
    index_of = {name: i for i, name in enumerate(names)}
    takers: dict[int, list[int]] = {}
    for i, args in enumerate(recorder.args):
        for arg in args:
            if arg.activation and i not in takers.setdefault(arg.storage, []):
                takers[arg.storage].append(i)
    flows = [_inputs_flow(recorder, index_of, i, takers) for i in range(len(names))]
    ids = recorder.key_ids()
    handed: list[set[int]] = [set() for _ in names]
    for key, first in saved.items():
        if first.segment in index_of:
            k = index_of[first.segment]
            if _handoff(flows, index_of, k, first.nbytes, savers.get(key, []),
                        takers.get(ids[key], []) if key in ids else []):
                handed[k].add(key)
    for i, held in enumerate(recorder.held_outputs):
        flows[i].output_held_bytes = sum(nbytes for key, nbytes in held.items()
                                         if key in saved and saved[key].segment == names[i] and key not in handed[i])
    for k, live in enumerate(recorder.live_inputs):
        flows[k].code_held_inputs = _code_held_inputs(recorder, flows, index_of, k, live)
        flows[k].input_saved_after_bytes, flows[k].input_saved_after_from = _saved_after(recorder, flows[k], index_of, k)
        flows[k].shared_freed = _shared_freed(recorder, flows, k)
        flows[k].shared_saved = _shared_saved(recorder, flows, index_of, k)
    for i, flow in enumerate(flows):
        flow.between_saved_bytes = saved_by_segment.get(between_name(i), 0) if i > 0 else 0
        flow.entry_bytes = flow.between_saved_bytes + flow.shared_entry_bytes + (flows[i - 1].handoff_bytes if i else 0)
    return flows


def _code_held_inputs(recorder: DataflowRecorder, flows: list[BlockFlow], index_of: dict[str, int], k: int,
                      live: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``(j, bytes)``: the inputs a checkpoint of an earlier block j holds (``held``, not saved by
    j) that are alive as block k begins and saved by nothing before it: the model's code holds
    them (x-transformers' list of attention scores holds those a residual-attention layer takes),
    so block k's ``fwd_other_bytes`` counts them, and a checkpoint of j holding them adds nothing
    to k's forward."""
    names = [name for name, _ in recorder.blocks]
    out: dict[int, int] = {}
    seen: set[int] = set()
    for j, sid in live:
        if sid in seen:
            continue
        record = recorder.storages[sid]
        held = [arg for arg in flows[j].inputs if arg.storage == sid and arg.counted == "held"]
        if not held or names[j] in record.savers or any(segment_position(s, index_of) < 2 * k + 1 for s in record.savers):
            continue
        seen.add(sid)
        out[j] = out.get(j, 0) + held[0].storage_bytes
    return tuple(sorted(out.items()))


def _shared_freed(recorder: DataflowRecorder, flows: list[BlockFlow], k: int) -> tuple[tuple[int, int], ...]:
    """``(storage id, bytes)``: the shared tensors of earlier blocks (``counted == "shared"``: a
    mask no block saves) that the model's code had freed by the time block ``k`` began (an audio
    tower's mask, dropped as the tower returns, before the language model's layers run). Its
    ``fwd_other_bytes`` counts them out; a checkpoint of one of their takers keeps them alive
    there (`remat.plan.predict.revived_profile`)."""
    out: dict[int, int] = {}
    for flow in flows[:k]:
        for arg in flow.inputs:
            if arg.counted == "shared" and arg.storage not in recorder.alive_at[k]:
                out[arg.storage] = arg.storage_bytes
    return tuple(sorted(out.items()))


def _shared_saved(recorder: DataflowRecorder, flows: list[BlockFlow], index_of: dict[str, int],
                  k: int) -> tuple[tuple[int, int, int], ...]:
    """``(storage id, bytes, saver)``: the shared tensors of earlier blocks (``counted == "shared"``:
    their first taker does not save them) that a later block ``saver`` (before block ``k``) saves
    first, alive as block ``k`` begins (RT-DETR's reference points with LoRA: its query-position
    head takes them first, frozen, and each decoder layer saves them). The saver's saved bytes count
    them as the first taker's entry does, so ``fwd_other_bytes`` (the temporaries less the entries)
    counts them out; where the saver does not save them (not kept), nothing else counts them in
    block ``k``'s forward (`remat.plan.variants.resaved_profile`)."""
    out: dict[int, tuple[int, int]] = {}
    for flow in flows[:k]:
        for arg in flow.inputs:
            if arg.counted != "shared" or arg.storage in out or arg.storage not in recorder.alive_at[k]:
                continue
            savers = recorder.storages[arg.storage].savers
            first = min(savers, key=lambda s: segment_position(s, index_of), default=None)
            if first in index_of and index_of[first] < k:
                out[arg.storage] = (arg.storage_bytes, index_of[first])
    return tuple((storage, nbytes, saver) for storage, (nbytes, saver) in sorted(out.items()))


def _saved_after(recorder: DataflowRecorder, flow: BlockFlow, index_of: dict[str, int], k: int) -> tuple[int, int]:
    """(bytes, m): block ``k``'s input that the block before handed on (held by it: its own
    saves, or its checkpoint), that code after it, between blocks or after the last, saves too
    (a norm on every layer's hidden states before a neck reads them: Depth Anything's backbone's
    feature maps). Inside a recompute segment no checkpoint holds it, yet that code's graph does,
    through the forward and the backward down to that code's: the backward of blocks ``m`` on and
    of the part after the blocks (m = the number of blocks: that part's alone). (0, 0): none."""
    nbytes, first = 0, 0
    seen: set[int] = set()
    for arg in flow.inputs:
        if arg.counted != "held" or arg.source != "previous" or arg.storage in seen:
            continue
        after = [segment_position(s, index_of) for s in recorder.storages[arg.storage].savers if s not in index_of]
        after = [position for position in after if position > 2 * k + 1]
        if after:
            seen.add(arg.storage)
            nbytes += arg.storage_bytes
            # several such storages (rare): each counted down to the earliest of their savers' backwards, a bound
            first = min(after) // 2 if not first else min(first, min(after) // 2)
    return nbytes, first


def _inputs_flow(recorder: DataflowRecorder, index_of: dict[str, int], i: int, takers: dict[int, list[int]]) -> BlockFlow:
    name = recorder.blocks[i][0]
    flow = BlockFlow()
    records, seen = [], set()
    for arg in recorder.args[i]:
        counted = _counted(recorder, index_of, i, takers, arg)
        source = _source(arg, index_of, i, takers)
        records.append(BlockInput(argument=arg.argument, storage=arg.storage, storage_bytes=arg.storage_bytes,
                                  source=source, activation=arg.activation, counted=counted,
                                  producer_storage=arg.number if source == "previous" or source.startswith("block:") else -1))
        if arg.storage in seen or counted in ("state", "earlier"):
            continue
        seen.add(arg.storage)
        if counted == "shared":
            flow.shared_entry_bytes += arg.storage_bytes
        else:
            flow.held_input_bytes += arg.storage_bytes
            flow.unsaved_input_bytes += 0 if name in recorder.storages[arg.storage].savers else arg.storage_bytes
    flow.inputs = tuple(records)
    return flow


def _counted(recorder: DataflowRecorder, index_of: dict[str, int], i: int, takers: dict[int, list[int]],
             arg: _Arg) -> str:
    """``state``, ``earlier`` (an earlier part saved it or an earlier block took it), ``shared``
    (later blocks take it too and this block does not save it) or ``held``."""
    if not arg.activation:
        return "state"
    savers = recorder.storages[arg.storage].savers
    if min(takers[arg.storage]) < i or any(segment_position(s, index_of) < 2 * i + 1 for s in savers):
        return "earlier"
    here = any(index_of.get(s) == i for s in savers)
    return "shared" if max(takers[arg.storage]) > i and not here else "held"


def _source(arg: _Arg, index_of: dict[str, int], i: int, takers: dict[int, list[int]]) -> str:
    """`remat.measure.types.BlockInput.source`."""
    if not arg.activation:
        return "outside"
    producer = arg.producer
    if producer in index_of:
        k = index_of[producer]
        return "previous" if k == i - 1 else f"block:{k}"
    if len(takers.get(arg.storage, [])) > 1:
        return "shared"
    return "between" if producer is not None and producer.startswith(BETWEEN) else "outside"


def _handoff(flows: list[BlockFlow], index_of: dict[str, int], k: int, nbytes: int, savers: list[str],
             takers: list[int]) -> bool:
    """A storage block ``k`` saved first: handed off (True) when something after it holds it too."""
    if k in takers:
        return False  # one of its own inputs: its checkpoint holds it
    later_savers = [s for s in savers if segment_position(s, index_of) > 2 * k + 1]
    later_takers = [j for j in takers if j > k]
    if not later_savers and not later_takers:
        return False
    flows[k].handoff_bytes += nbytes
    if all(index_of.get(s) == k + 1 for s in later_savers) and all(j == k + 1 for j in later_takers):
        flows[k].handoff_next_bytes += nbytes
    return True
