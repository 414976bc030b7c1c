"""The op calls of each block whose outputs the model's code holds to the end of its forward
(and as the post part's forward begins), and those it holds past the next block's forward.

A block's outputs that the code keeps (``output_attentions=True``: Hugging Face's output
recorder collects every layer's attention weights into the model's output) stay live through
the head and the loss whatever the block's strategy. Kept, the block saves them anyway (a
softmax saves its result); recomputed, nothing saves them, yet they are live: a Llama recomputing
three of its four layers measured 10.7 % above its prediction at the head's forward.

Which calls those are cannot be read off the accounting step, where autograd holds every saved
output too. One forward under ``torch.no_grad()`` can: nothing is saved, so whatever a block's
calls made that is still live when the model returns (its output still held) is held by the
code. The calls are named as the op table names them (``"<aten overload>#<occurrence>"`` within
the block's forward); a forward that runs other calls without gradients than with them (a path
chosen on ``torch.is_grad_enabled()``) names calls the op table may not have, and those count
nothing.

The same forward says which calls' outputs the code still holds as each later block starts
(x-transformers keeps every layer's attention scores in a list to the end of its layers'
forward, inside a dataclass the block returns): `CodeHeld.during`. Kept, the block saves them; recomputed, they are
live in every forward they outlive.

And which calls' outputs the mutable containers among a block's arguments hold as the last
block's forward ends (Gemma 4 hands every layer the mapping ``shared_kv_states``, and its storing
layers write their keys and values to it; prefix tuning hands every layer a key/value cache
filled with its virtual tokens, and each layer appends its keys and values): `CodeHeld.stored`. A checkpoint of the block holds its
arguments, the container with them, to the end of its backward: whatever the blocks wrote there
is live as long, whatever their strategy, where the model's code let it go as the forward returned.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._batch import LossFn, call_model, compute_loss
from remat.checkpointing.caches import cache_tensors, is_kv_cache
from remat.measure.blocks import Blocks
from remat.measure.calls import first_output
from remat.measure.dataflow import named_tensors
from remat.measure.storage import flat_tensors, storage_key, storage_nbytes, storage_of, tensors_in

__all__ = ["code_held_calls", "CodeHeld"]


@dataclass(frozen=True)
class CodeHeld:
    """What the code holds of each block's calls (keys as the op table names them)."""

    end: list[frozenset[str]]
    """Per block, its calls whose storages are live when the model's forward returns."""
    post: list[frozenset[str]]
    """Per block, its calls whose storages are live as the model's last call after the last
    block's begins (its head's projection): a list of every layer's attention scores that the
    forward drops only as it returns is live there, not through the loss; what the layer around a
    sub-layer block drops as it returns (attention weights) is not."""
    during: list[dict[int, frozenset[str]]]
    """Per block j, for each later block k whose forward starts with some of j's call storages
    live (not among k's arguments, not what j hands on), those calls' keys."""
    stored: list[dict[int, frozenset[str]]]
    """Per block j, for each block i (j itself, one before or after it) whose call storages the
    mutable containers among j's arguments (mappings and lists, a dict's values) hold as the last
    block's forward ends (not j's tensor arguments, not what i hands on), those calls' keys."""
    through: list[int]
    """Per block, the bytes of its input that the block before handed on and the code still
    holds once the loss is computed and the model's output dropped, as a step's backward begins:
    a forward hook's list of every block's output (``output_hidden_states=True`` returns them:
    a step drops them with the output)."""
    saved_through: list[frozenset[str]]
    """Per block, its calls whose storages are live then too, less what it hands on: the weight
    ``torch.nn.utils.spectral_norm``'s pre-hook leaves on the module as a plain attribute."""
    kept: list[tuple[int, int]]
    """Per block, that input's bytes and the last block whose forward begins with the code still
    holding it (the number of blocks: the post part's forward too, or the model's return;
    ``(0, 0)``: none): a tuple of every layer's hidden states the output returns."""


class _Calls(TorchDispatchMode):
    """Each block's calls with weak references to the storages they made."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.current: int | None = None
        self.counts: list[dict[str, int]] = [defaultdict(int) for _ in range(count)]
        self.made: list[list[tuple[str, weakref.ref]]] = [[] for _ in range(count)]
        self.handed: list[weakref.ref | None] = [None] * count
        """Per block, the storage of what it hands on (its first output): the next block's input,
        or the post part's; the model's output when it is the last block's. Where that lives is
        the next block's and the post part's to count."""
        self.in_post = False
        """The last block has returned, the model's forward has not."""
        self.at_post: list[frozenset[str]] | None = None
        """`live` as the model's last call after the last block began (its head's projection)."""
        self.containers: list[tuple[list[Any], list[weakref.ref]]] = [([], []) for _ in range(count)]
        """Per block, the mutable containers among its arguments (held until the last block ends)
        and its tensor arguments' storages (weakly: a dead one's address may be a new storage's)."""
        self.stored: list[dict[int, frozenset[str]]] = [{} for _ in range(count)]
        """`in_containers` as the last block's forward ended."""
        self.takes: list[weakref.ref | None] = [None] * count
        """Per block, the storage the block before handed on where it is among this block's
        arguments (the chain's hidden state)."""
        self.take_bytes: list[int] = [0] * count
        """Per block, the bytes of `takes`."""
        self.kept_until: list[int] = [0] * count
        """Per block, the last block whose forward began with `takes` of this one live (the number
        of blocks: the post part's too, or the model's return; 0: none)."""

    def through(self) -> list[int]:
        """Per block, the bytes of `takes` still live now (0: none, or dead)."""
        return [0 if ref is None or ref() is None else ref().nbytes() for ref in self.takes]

    def keep_taken(self, position: int) -> None:
        """`kept_until` of the `takes` before ``position`` live now."""
        for j, ref in enumerate(self.takes[:position]):
            if ref is not None and ref() is not None:
                self.kept_until[j] = position

    def in_containers(self) -> list[dict[int, frozenset[str]]]:
        """Per block j, the calls of each block whose storages j's containers hold now."""
        out: list[dict[int, frozenset[str]]] = []
        for containers, refs in self.containers:
            held = {storage_key(t) for c in containers for t in tensors_in(_contents(c))}
            if not held:
                out.append({})
                continue
            arguments = {storage._cdata for storage in (ref() for ref in refs) if storage is not None}
            found = {i: frozenset(key for key, ref in made if _held(ref, handed, arguments) and ref()._cdata in held)
                     for i, (made, handed) in enumerate(zip(self.made, self.handed))}
            out.append({i: keys for i, keys in found.items() if keys})
        return out

    def live(self) -> list[frozenset[str]]:
        """Per block, its calls whose storages are live now, less what it hands on."""
        return [frozenset(key for key, ref in made if ref() is not None and not _same(ref, handed))
                for made, handed in zip(self.made, self.handed)]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.in_post and self.current is None:  # what the code still holds at this call of the post part
            self.at_post = self.live()
            self.keep_taken(len(self.takes))
        out = func(*args, **(kwargs or {}))
        block = self.current
        if block is not None:
            name = str(func)
            key = f"{name}#{self.counts[block][name]}"
            self.counts[block][name] += 1
            if _cached_cast(name, args):
                return out
            inputs = {storage_key(t) for t in flat_tensors(args, kwargs)}
            for t in flat_tensors((out,)):
                if storage_key(t) not in inputs and storage_nbytes(t) > 0:
                    self.made[block].append((key, weakref.ref(storage_of(t))))
        return out


def code_held_calls(model: torch.nn.Module, batch: Any, block_list: Blocks,
                    loss_fn: LossFn | None = None) -> CodeHeld:
    """Per block, the keys of its calls whose storages are live when the model's forward returns,
    other than what the block hands on, and as each later block starts, other than that block's
    arguments; run once without gradients; the loss then runs on the output as in
    a step (a loss that reads what the model's hooks collected clears it), and what is still live
    once the output is dropped is held through the backward (`CodeHeld.through`,
    ``saved_through``). The caller restores what a forward changes (buffers, the RNG)."""
    calls = _Calls(len(block_list))
    during: list[dict[int, frozenset[str]]] = [{} for _ in block_list]
    started: set[int] = set()
    handles = []
    for index, (_, module) in enumerate(block_list):
        def enter(_module: Any, args: tuple, kwargs: dict, index: int = index) -> None:
            calls.current = index
            if index in started:  # a block called again (a shared layer): its first call counts
                return
            started.add(index)
            arguments = {storage_key(t) for t in flat_tensors(args, kwargs)}
            calls.containers[index] = (_containers(args, kwargs), _weak_storages(named_tensors(args, kwargs)))
            previous = calls.handed[index - 1] if index else None
            if previous is not None and previous() is not None and previous()._cdata in arguments:
                calls.takes[index] = previous
                calls.take_bytes[index] = previous().nbytes()
            calls.keep_taken(index)  # the inputs of the blocks before this one the code still holds
            for j in range(index):
                calls.made[j] = [(key, ref) for key, ref in calls.made[j] if ref() is not None]  # what died stays dead
                live = frozenset(key for key, ref in calls.made[j] if _held(ref, calls.handed[j], arguments))
                if live:
                    during[j][index] = live

        def leave(_module: Any, _args: Any, output: Any, index: int = index) -> None:
            calls.current = None
            first = first_output(output)
            if first is not None and calls.handed[index] is None:
                calls.handed[index] = weakref.ref(storage_of(first))
            calls.in_post = index == len(block_list) - 1
            if calls.in_post:  # what the blocks wrote to containers a checkpoint of theirs would hold
                calls.stored = calls.in_containers()
                calls.containers = [([], []) for _ in block_list]

        handles += [module.register_forward_pre_hook(enter, with_kwargs=True), module.register_forward_hook(leave)]
    try:
        with torch.no_grad(), calls:
            output = call_model(model, batch)
            calls.in_post = False  # the loss's calls come after the model's return
            held = calls.live()
            calls.keep_taken(len(block_list))
            # what the post part's forward began with (it held no less than what the return holds)
            post = held if calls.at_post is None else [now | then for now, then in zip(held, calls.at_post)]
            calls.current = None
            compute_loss(output, batch, loss_fn)
            del output
            through = calls.through()  # the step's backward runs without the output (`remat.measure.profile`)
            saved_through = calls.live()
    finally:
        for handle in handles:
            handle.remove()
    return CodeHeld(end=held, post=post, during=during, stored=calls.stored, through=through, saved_through=saved_through,
                    kept=[(nbytes, until) if until else (0, 0) for nbytes, until in zip(calls.take_bytes, calls.kept_until)])


def _containers(args: tuple, kwargs: dict) -> list[Any]:
    """The mutable mappings and lists among a call's arguments, and among a dict's values there,
    and the Hugging Face key/value caches (prefix tuning hands every layer one filled with its
    virtual tokens, and each layer appends its keys and values to it)."""
    values = [*args, *kwargs.values()]
    values += [v for value in values if isinstance(value, dict) for v in value.values()]
    return [value for value in values if isinstance(value, (MutableMapping, list)) or is_kv_cache(value)]


def _contents(container: Any) -> list[Any]:
    """A mapping's values, a list's items or a cache's tensors (none where a mapping cannot list
    them)."""
    if is_kv_cache(container):
        return cache_tensors(container)
    try:
        return list(container.values()) if isinstance(container, MutableMapping) else list(container)
    except Exception:  # noqa: BLE001 - a mapping of the model's own kind
        return []


def _weak_storages(named: list[tuple[str, torch.Tensor]]) -> list[weakref.ref]:
    out = []
    for _, t in named:
        try:
            out.append(weakref.ref(storage_of(t)))
        except (NotImplementedError, RuntimeError, IndexError):  # no storage (sparse, nested)
            pass
    return out


def _cached_cast(name: str, args: tuple) -> bool:
    """A cast of a parameter: autocast's cache holds it to the autocast's exit, the code does not
    (a replayed block's casts are made uncached, `remat.checkpointing.region`)."""
    if name != "aten._to_copy.default" or not args or not isinstance(args[0], torch.Tensor):
        return False
    first = args[0]  # (autocast reads as off in here: a dispatch mode runs below its key)
    return first.is_leaf and first.requires_grad


def _held(ref: weakref.ref, handed: weakref.ref | None, arguments: set[int | None]) -> bool:
    storage = ref()
    return storage is not None and not _same(ref, handed) and storage._cdata not in arguments


def _same(ref: weakref.ref, other: weakref.ref | None) -> bool:
    return other is not None and ref() is other()
