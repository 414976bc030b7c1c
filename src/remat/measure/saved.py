"""Saved-tensor accounting: which storages autograd keeps for backward, and who saved them.

A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves during forward. Each
storage is counted once, at its first save, and attributed to the segment running at that
moment: ``"pre"`` (before the first block), a block's qualified name, ``"between:<i>"`` (code
run after block i-1 and before block i: pooling, patch merging, an encoder's final norm and a
decoder's embeddings) or ``"post"`` (after the last block: final norm, head, loss); blocks in
the order they run. Every segment that saves a storage is recorded too (`SavedAccountant.savers`:
a storage saved by a block and again by the pooling after it outlives a checkpoint of the
block). Storages that existed before the step (parameters, buffers, the batch, a table the model
cached in an earlier step) are never counted: they are model state or input, not activations; nor
is one freed before the segment that saved it ends (a side branch it dropped). Works on the meta device.

Module hooks on the blocks also record each block's input and output bytes (distinct
storages of its tensor arguments and results).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from remat.measure.blocks import Blocks
from remat.measure.storage import distinct_bytes, storage_key, storage_keys, storage_nbytes, storage_of, tensors_in

PRE = "pre"
POST = "post"
BETWEEN = "between:"


def between_name(index: int) -> str:
    """The segment of the code run after block ``index - 1`` and before block ``index``."""
    return f"{BETWEEN}{index}"

OnSaved = Callable[[torch.Tensor, int, str], None]


@dataclass(kw_only=True, frozen=True)
class SavedStorage:
    """One storage autograd saved."""

    nbytes: int
    """Bytes of the whole storage."""
    segment: str
    """``"pre"``, a block name or ``"post"``: who saved it first."""


class SavedAccountant:
    """Context manager: counts saved storages per segment during one forward.

    ``exclude``: tensors whose storages are never counted (parameters, buffers, batch);
    ``made_in_step(t)``: False for a tensor whose storage existed before the step (a table a
    model builds once and caches, BEiT's relative position index: 33800 bytes of a 2-layer
    model were counted as block 0's activations), never counted either.
    ``on_saved(tensor, nbytes, segment)`` is called at each first save of a storage;
    ``on_pack(segment)`` at every save, parameters and storages saved before included (what
    torch's early-stopping replay counts, `remat.measure.ops.OpRecorder.note_pack`).
    """

    def __init__(self, blocks: Blocks, exclude: Iterable[torch.Tensor] = (), on_saved: OnSaved | None = None,
                 on_pack: Callable[[str], None] | None = None,
                 made_in_step: Callable[[torch.Tensor], bool] | None = None) -> None:
        self.blocks = blocks
        self.segment = PRE
        self.saved: dict[int, SavedStorage] = {}
        self.savers: dict[int, list[str]] = {}
        """Storage key -> every segment that saved it, in the order they first did."""
        self._totals: dict[str, int] = {}
        self.input_bytes: dict[str, int] = {}
        self.output_bytes: dict[str, int] = {}
        self.output_passed_bytes: dict[str, int] = {}
        """Block name -> of its output bytes, the storages among its inputs (`BlockProfile.output_passed_bytes`)."""
        self._input_keys: dict[str, set[int]] = {}
        self._excluded = storage_keys(exclude)
        self._on_saved = on_saved
        self.on_pack = on_pack
        self._after: dict[str, str] = {}
        """Block name -> the segment that runs after it (`between_name`, or ``post``)."""
        self.dropped_bytes: dict[str, int] = {}
        """Block name -> what it saved that the code right after it freed (`_freed`)."""
        self._made_in_step = made_in_step
        self._finalizers: dict[int, weakref.finalize] = {}
        self._forward_open = True
        self._handles: list = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.on_unpack: Callable[[str], None] | None = None
        """Called with the segment that saved it at every read of a saved tensor in a backward:
        a checkpoint's replay begins at the first of its segment's (`remat.measure.windows`)."""
        self._packed_by: dict[int, tuple[weakref.ref, str]] = {}
        """id of what the pack hook returned during the forward -> (a weak reference to it, the
        segment that saved it), for `_unpack` to tell whose saved tensor the backward reads."""
        self.backward_tasks: dict[str, set[int]] = {}
        """Segment -> the autograd graph tasks (backward passes) that read its saved tensors: more
        than one when the step runs a backward through it twice (``retain_graph=True``, or a
        gradient taken with ``create_graph=True`` and the loss's backward after it)."""
        self.graph_building: set[str] = set()
        """Segments whose saved tensors a backward read while building a graph of its own
        (``torch.autograd.grad(..., create_graph=True)``: a gradient penalty, a physics-informed
        loss): what that backward computes from them is saved again for the second backward."""

    def bytes_by_segment(self) -> dict[str, int]:
        """Saved bytes per segment, every segment present (0 when nothing saved)."""
        betweens = {between_name(i): 0 for i in range(1, len(self.blocks))}
        return {PRE: 0, **{name: 0 for name, _ in self.blocks}, **betweens, POST: 0, **self._totals}

    def segment_bytes(self, segment: str) -> int:
        """Saved bytes of one segment so far."""
        return self._totals.get(segment, 0)

    def __enter__(self) -> SavedAccountant:
        for index, (name, module) in enumerate(self.blocks):
            after = between_name(index + 1) if index + 1 < len(self.blocks) else POST
            self._handles.append(module.register_forward_pre_hook(self._enter_block(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave_block(name, after)))
            self._after[name] = after
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:  # dropped: the hooks hold ``self._pack``, a cycle that would keep the
            self._hooks.__exit__(*exc)  # blocks (a verified copy of the model) until the collector ran
            self._hooks = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()
        self._packed_by.clear()

    def _enter_block(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if torch._C._current_graph_task_id() == -1:
                self.segment = name
                inputs = tensors_in((args, kwargs))
                self.input_bytes[name] = distinct_bytes(inputs)
                self._input_keys[name] = storage_keys(inputs)

        return hook

    def _leave_block(self, name: str, after: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if torch._C._current_graph_task_id() == -1:
                outputs = tensors_in(output)
                self.output_bytes[name] = distinct_bytes(outputs)
                inputs = self._input_keys.pop(name, set())
                self.output_passed_bytes[name] = distinct_bytes(t for t in outputs if storage_key(t) in inputs)
                self.segment = after

        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # A detached alias (`_alias`), not ``t``: autograd keeps what the hook returns, and an op that saves
        # its own output (exp, tanh, softmax) would otherwise hold it through its grad_fn, a cycle
        # only the garbage collector frees, so a graph the forward drops would stay alive.
        if torch._C._current_graph_task_id() != -1:  # saved in the backward (a reentrant checkpoint's
            return _alias(t)  # replay, a custom Function's graph): the backward's temporaries, not activations
        if self.on_pack is not None:
            self.on_pack(self.segment)
        out = self._counted(t)
        self._packed_by[id(out)] = (weakref.ref(out), self.segment)
        return out

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        packed = self._packed_by.get(id(t))
        task = torch._C._current_graph_task_id()
        if packed is not None and packed[0]() is t and task != -1:
            self.backward_tasks.setdefault(packed[1], set()).add(task)
            if self.on_unpack is not None:
                self.on_unpack(packed[1])
            if torch.is_grad_enabled():  # the engine runs a backward with grad mode on only under create_graph
                self.graph_building.add(packed[1])
        return t

    def _counted(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s alias, its storage counted as the current segment's when it is the first save."""
        key = storage_key(t)
        if key is None or key in self._excluded or (self._made_in_step is not None and not self._made_in_step(t)):
            return _alias(t)
        savers = self.savers.setdefault(key, [])
        if self.segment not in savers:
            savers.append(self.segment)
        if key in self.saved:
            return _alias(t)
        nbytes = storage_nbytes(t)
        self.saved[key] = SavedStorage(nbytes=nbytes, segment=self.segment)
        self._totals[self.segment] = self._totals.get(self.segment, 0) + nbytes
        self._finalizers[key] = weakref.finalize(storage_of(t), self._freed, key)
        if self._on_saved is not None:
            self._on_saved(t, nbytes, self.segment)
        return _alias(t)

    def _freed(self, key: int) -> None:
        """A counted storage was freed. During the backward that is its use ending, and from then
        on nothing is taken back. During the forward, the graph that saved it was dropped: its key
        goes (it may name a new storage next), and if the segment that saved it is still running
        (a side branch a block computes and discards: Informer's sampled scores) its count goes
        too, as one of that segment's temporaries. Freed by the code right after the block (a
        stream the model drops after its last layer: PegasusX's global tokens, whose last update
        the encoder never returns), likewise, and noted in `dropped_bytes`: the block's forward
        temporaries count it (`remat.measure.profile`), none of its backward does (counted as
        saved, it was 5.9 % over the peak of keeping every layer, and its backward's window
        opened below the bytes counted: a replay of it measured 3.8 % above its prediction).
        Freed later (the output of a layer the model drops, LLaVA's last vision layer, lives on
        in the hidden states it returns), it stays counted as held to the backward: an upper
        bound, where not counting it left the forward's peak 6 % under."""
        self._finalizers.pop(key, None)
        if torch._C._current_graph_task_id() != -1:
            self._forward_open = False
        if not self._forward_open:
            return
        saved = self.saved.pop(key, None)
        self.savers.pop(key, None)
        if saved is None:
            return
        if saved.segment == self.segment:
            self._totals[saved.segment] -= saved.nbytes
        elif self.segment.startswith(BETWEEN) and self._after.get(saved.segment) == self.segment:
            self._totals[saved.segment] -= saved.nbytes
            self.dropped_bytes[saved.segment] = self.dropped_bytes.get(saved.segment, 0) + saved.nbytes


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, unseen by the dispatch modes that watch the step (the op recorder, the live
    tracker): a view of the same storage with no graph, not an op of the model. A wrapper
    subclass (a tensor-parallel DTensor) makes its own alias: with torch dispatch disabled it
    would come back a plain tensor, and the backward would mix it with DTensors."""
    if is_traceable_wrapper_subclass(t):
        with _disable_current_modes():
            return t.detach()
    with torch._C._DisableTorchDispatch():
        return t.detach()
