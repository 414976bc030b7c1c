"""The block runtime: how an applied plan runs the user's own forward, unmodified.

`apply_` sets each planned block's ``forward`` to a `BlockForward` instance attribute (the class
keeps its own ``forward``; ``state_dict`` keys do not change). When the user's forward calls the
first block of a segment, the runtime runs the whole segment ``[start, stop)`` inside one
checkpoint region: block ``start`` with the arguments the user gave, then each following block
with the previous block's output (its first element for tuple outputs, as Hugging Face layers
return) and the same extra arguments and keyword arguments (attention masks, position ids).
The outputs of blocks ``start+1..stop-1`` wait in ``pending`` and are returned when the user's
forward calls those blocks; the call must then carry exactly the predicted arguments (tensors
by identity or as a whole alias: `remat.measure.calls.same_arguments`, the rule the profile's ``follows_previous``
and the planners' joins use), otherwise the segment cannot be replayed faithfully and the call
is an error.

Inside a region blocks run through their original ``forward`` (no module hooks), so a block's
hooks fire once per step, on the user's call. Listeners (`block_listeners`) hear every block
run by the runtime, in the forward and in the replay, for per-block accounting.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._batch import PER_SAMPLE
from remat.checkpointing.caches import drop_kv_caches
from remat.checkpointing.region import BufferGuard, first_argument, replaying
from remat.measure.calls import first_output, same_arguments, same_tensor
from remat.plan.types import Segment

Listener = Callable[[int, bool], None]
"""``listener(block_index, entering)``: called before (True) and after (False) a block runs."""

_LISTENERS: list[Listener] = []


@contextlib.contextmanager
def block_listener(listener: Listener) -> Iterator[None]:
    """Make ``listener`` hear every block the runtime runs while the context is open."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


def _named_first(name: str, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    """A keyword-called block's input, its other keyword arguments and the input's name."""
    try:
        first, _, rest, key = first_argument((), kwargs)
    except TypeError as exc:
        raise TypeError(f"block {name!r}: {exc}") from None
    return first, rest, key or ""


def first_of(output: Any) -> Any:
    """The value a block passes on to the next block: the output, or its first element."""
    handed = first_output(output)
    if handed is not None:
        return handed
    raise TypeError(
        f"a block inside a multi-block segment returned {type(output).__name__}; segments spanning "
        "several blocks need blocks that return a tensor or a tuple whose first element is the "
        "next block's input. Plan single-block segments for this model."
    )


@dataclass(kw_only=True)
class _Pending:
    """The output of a block already computed inside its segment's region."""

    expected_first: Any
    extra: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any

    def matches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if not args or not same_tensor(args[0], self.expected_first):
            return False
        return same_arguments(args[1:], kwargs, self.extra, self.kwargs)


class BlockForward:
    """The ``forward`` instance attribute of a planned block: hands the call to the runtime.

    A plain object (not a closure), so `copy.deepcopy` of an applied model copies the runtime
    with the model and the copy drives its own blocks."""

    def __init__(self, runtime: Runtime, index: int) -> None:
        self.runtime = runtime
        self.index = index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runtime.call_block(self.index, args, kwargs)


class Runtime:
    """Runs the segments of one applied plan on one model's blocks."""

    def __init__(self, *, blocks: list[nn.Module], block_names: tuple[str, ...], segments: tuple[Segment, ...],
                 handlers: dict[str, Callable[..., list[Any]]], options: dict[str, Any]) -> None:
        self.blocks = blocks
        self.block_names = block_names
        self.heads = {seg.start: seg for seg in segments if seg.kind != "keep"}
        self.handlers = handlers
        self.options = options
        """Per-apply settings: ``plan`` (the applied Plan), ``offload_engines`` (target -> engine),
        ``cache_off`` (`remat.checkpointing.caches.CacheOff`)."""
        self.saved_forwards: dict[int, Any] = {}
        """Instance ``forward`` attributes the blocks had before apply_ (restored by remove_)."""
        self.pending: dict[int, _Pending] = {}
        self.mutating: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        """Buffers a region's forward changes, per (start, stop, training modes): the store of
        `remat.checkpointing.region.BufferGuard`."""
        self.first_keys: dict[int, str] = {}
        """Blocks the model calls with keyword arguments only: the name of the one passed through
        the checkpoint (`remat.checkpointing.region.first_argument`)."""
        self.guards: dict[tuple[int, int], Any] = {
            (seg.start, seg.stop): BufferGuard(blocks[seg.start : seg.stop], self.mutating, (seg.start, seg.stop))
            for seg in _checkpointed_regions(segments)}
        """The `remat.checkpointing.region.BufferGuard` of each checkpointed region ``(start, stop)``,
        nested ones included, all made here: made on a region's first call, a nested region's
        would be stored inside its parent's checkpoint, which ``torch.compile`` refuses (a
        side effect inside a higher-order op)."""

    # -- installing -------------------------------------------------------------------------
    def planned_indices(self) -> list[int]:
        return [i for seg in self.heads.values() for i in range(seg.start, seg.stop)]

    def install(self) -> None:
        for i in self.planned_indices():
            block = self.blocks[i]
            if "forward" in block.__dict__:
                self.saved_forwards[i] = block.__dict__["forward"]
            block.forward = BlockForward(self, i)
        self.first_params = {i: next(self.blocks[i].parameters(), None) for i in self.planned_indices()}
        """The first parameter of each planned block as applied: `_check_segment` tells from it a
        block wrapped on its own since, or given per-sample gradient hooks."""

    def _check_segment(self, seg: Segment) -> None:
        """Refuse a segment whose blocks Opacus's per-sample gradient hooks reach (`PER_SAMPLE`),
        or whose later blocks FSDP1 wrapped on their own after apply_: the runtime runs them from the
        first block's call, inside that block's wrapper, so their own wrapper never gathers their
        flattened parameters (a block would see shards: "mat2 must be a matrix", "weight of shape [0]")."""
        for i in range(seg.start, seg.stop):
            first = self.first_params.get(i)
            if first is None:
                continue
            if hasattr(first, "_forward_counter"):
                raise RuntimeError(f"block {self.block_names[i]!r} cannot be replayed: {PER_SAMPLE}. Train with Opacus "
                                   "without a remat plan (remat.remove_(model)).")
            if i == seg.start:
                continue
            now = next(self.blocks[i].parameters(), None)  # FSDP1: flagged views, or none (flat parameters)
            if now is None or getattr(now, "_fsdp_flattened", False):
                raise RuntimeError(
                    f"block {self.block_names[i]!r} runs inside the recompute segment [{seg.start}, {seg.stop}) from block "
                    f"{self.block_names[seg.start]!r}'s call, but its parameters were flattened since the plan was applied "
                    "(FSDP1, FullyShardedDataParallel, wrapping each block): its wrapper would never gather them. "
                    "Shard with FSDP2 by the plan (remat.distributed.fully_shard_by_plan: a segment is one unit), or plan "
                    "one-block segments for FSDP1 (strategy 'full' or 'every:1')."
                )

    def uninstall(self) -> None:
        """Restore every planned block's own ``forward`` (those this runtime installed; a block
        not installed yet, as after a failed `apply_`, is left as it is)."""
        for i in self.planned_indices():
            block = self.blocks[i]
            mine = block.__dict__.get("forward")
            if isinstance(mine, BlockForward) and mine.runtime is self:
                del block.__dict__["forward"]
                if i in self.saved_forwards:
                    block.forward = self.saved_forwards.pop(i)
        self.pending.clear()

    # -- running ----------------------------------------------------------------------------
    def original_forward(self, index: int) -> Callable[..., Any]:
        block = self.blocks[index]
        saved = self.saved_forwards.get(index)
        # a partial, not ``forward.__get__(block)``: torch 2.11's dynamo refuses that call inside a checkpoint
        return saved if saved is not None else functools.partial(type(block).forward, block)

    def run_raw(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run block ``index``'s own forward (no hooks), telling the listeners; a block the model
        calls with keyword arguments only gets its first one back by name (`first_keys`)."""
        key = self.first_keys.get(index)
        if key is not None and args:
            args, kwargs = args[1:], {key: args[0], **kwargs}
        if not _LISTENERS:  # every planned block call and replay comes here: no copy when none listen
            return self.original_forward(index)(*args, **kwargs)
        for listener in tuple(_LISTENERS):
            listener(index, True)
        try:
            return self.original_forward(index)(*args, **kwargs)
        finally:
            for listener in tuple(_LISTENERS):
                listener(index, False)

    def call_block(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        pending = self.pending.pop(index, None)
        if pending is not None:
            return self._take(index, pending, args, kwargs)
        seg = self.heads.get(index)
        if seg is None or not torch.is_grad_enabled():
            return self.run_raw(index, args, kwargs)
        for i in range(seg.start, seg.stop):
            self.pending.pop(i, None)
        if not args:  # called with keywords only: its first tensor goes through the checkpoint
            if seg.stop - seg.start > 1:
                raise ValueError(
                    f"block {self.block_names[index]!r} heads a segment of {seg.stop - seg.start} blocks but "
                    "was called with keyword arguments only; remat chains a segment's blocks through "
                    "their first positional argument. Plan single-block segments for these blocks."
                )
            first, rest, key = _named_first(self.block_names[index], kwargs)
            self.first_keys[index] = key
            args, kwargs = (first,), rest
        plan = self.options.get("plan")
        if plan is not None and plan.fingerprint.shared_cache:  # the step reads what its blocks write there:
            run_args, run_kwargs = args, kwargs  # theirs (a block handed one is kept or offloaded, never replayed)
        else:
            run_args, run_kwargs = drop_kv_caches(args, kwargs)
        self._check_segment(seg)
        outputs = self.run_segment(seg, run_args[0], run_args[1:], run_kwargs)
        for offset in range(1, len(outputs)):
            self.pending[index + offset] = _Pending(
                expected_first=first_of(outputs[offset - 1]), extra=args[1:], kwargs=kwargs,
                output=outputs[offset],
            )
        return outputs[0]

    def _take(self, index: int, pending: _Pending, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not pending.matches(args, kwargs):
            raise ValueError(
                f"block {self.block_names[index]!r} runs inside a multi-block segment, so remat "
                "computed it from the previous block's output and the same extra arguments, but the "
                "model called it with different arguments. Plan single-block segments for this "
                "model (e.g. strategy full), or call the blocks as x = block(x, *same_args)."
            )
        return pending.output

    def run_segment(self, seg: Segment, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Outputs of blocks ``seg.start..seg.stop-1``, run by the handler of ``seg.kind``."""
        handler = self.handlers.get(seg.kind)
        if handler is None:
            raise ValueError(f"no handler for strategy {seg.strategy!r}; known: {sorted(self.handlers)}.")
        return handler(self, seg, first, extra, kwargs)

    def run_plain(self, start: int, stop: int, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any],
                  context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None) -> list[Any]:
        """Run blocks ``start..stop-1`` one after the other, without checkpointing (each inside
        ``context(i)`` when given). In a replay (`remat.checkpointing.region.replaying`) only the
        last output is returned, the others as None: nothing reads them, and held to the end they
        would keep every block's input the next block does not save alive through the replay
        (an adapter's, read by a frozen matmul and a residual add)."""
        return self._run_chain(start, stop, [first], extra, kwargs, context)

    def _run_chain(self, start: int, stop: int, box: list[Any], extra: tuple[Any, ...], kwargs: dict[str, Any],
                   context: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None) -> list[Any]:
        """`run_plain` with its first input in ``box``, taken out here: a caller that hands it on
        holds only the box. An argument passed as itself stays on the caller's stack to the
        call's end once an interpreter frame hook is installed (PEP 523: `torch.compile` sets one),
        which kept a replay's nested child's output through every block after it."""
        first = box.pop()
        outputs = []
        drop = replaying()
        for i in range(start, stop):
            if context is None:
                out = self.run_raw(i, (first, *extra), kwargs)
            else:
                with context(i):
                    out = self.run_raw(i, (first, *extra), kwargs)
            if i + 1 < stop:
                first = first_of(out)
                if drop:
                    out = None
            outputs.append(out)
        return outputs

    def run_layout(self, seg: Segment, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Run ``seg``'s blocks with its children checkpointed and the other blocks kept."""
        if not seg.children:
            return self.run_plain(seg.start, seg.stop, first, extra, kwargs)
        outputs: list[Any] = []
        drop = replaying()  # as in `run_plain`: a part's last output goes once the next part has it

        def next_input() -> Any:
            out = first_of(outputs[-1])
            if drop:
                outputs[-1] = None
            return out

        # A part's input is handed on, never held here: a local naming it would keep a block's
        # output through the next part, which need not save it.
        pos = seg.start
        for child in sorted(seg.children, key=lambda c: c.start):
            for part in ((pos, child.start, None), (child.start, child.stop, child)):
                if part[0] >= part[1]:
                    continue
                if part[2] is None:
                    outputs += self._run_chain(part[0], part[1], [next_input() if outputs else first], extra, kwargs)
                else:
                    outputs += self.run_segment(part[2], next_input() if outputs else first, extra, kwargs)
            pos = child.stop
        if pos < seg.stop:
            outputs += self._run_chain(pos, seg.stop, [next_input() if outputs else first], extra, kwargs)
        return outputs


def _checkpointed_regions(segments: tuple[Segment, ...]) -> list[Segment]:
    """Every recompute and selective segment of ``segments``, children included."""
    out: list[Segment] = []
    for seg in segments:
        if seg.kind in ("recompute", "selective"):
            out.append(seg)
        out += _checkpointed_regions(seg.children)
    return out
