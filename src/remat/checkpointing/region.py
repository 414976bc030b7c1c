"""One checkpointed call of a run of blocks, as the applied runtime and the profile's probes run it.

`checkpointed` runs ``body`` inside `torch.utils.checkpoint.checkpoint` with
``use_reentrant=False`` and ``preserve_rng_state=True`` (CPU and device generators restored
before the replay, so dropout masks repeat) and the autocast state of the forward.
``early_stop``: torch stops the replay once it has recomputed the last tensor the region saved
(`remat.plan.types.Segment.stops_early` says when the runtime asks for it; the planner prices
and `remat.verify` counts the replay's op calls up to there,
`remat.measure.types.BlockProfile.replay_stop_calls`); otherwise the replay runs the whole body,
once per backward.

`BufferGuard` keeps buffers (BatchNorm running statistics...) advancing once per step although
the replay runs the forward again.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from remat.checkpointing.attributes import MODULE_INTERNALS, AttributeSnapshot, buffer_owners, put_back, snapshot
from remat.checkpointing.caches import CacheState, kv_caches_in
from remat.checkpointing.callsites import layers_of

__all__ = ["BufferGuard", "Body", "checkpointed", "replaying", "first_argument", "call_with_first"]

Body = Callable[[Any, tuple[Any, ...]], list[Any]]
"""``body(first, extra) -> outputs``: runs the region's blocks from input ``first``."""


def first_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any], str | None]:
    """``(first, extra, kwargs, key)``: the argument a region passes through its checkpoint and
    the rest. The first positional argument (``key`` None), or, for a block called with keyword
    arguments only (Hugging Face's attention and MLP modules: ``self_attn(hidden_states=...)``),
    the first keyword argument that holds a tensor (``key``: its name). TypeError when there is
    neither."""
    if args:
        return args[0], args[1:], kwargs, None
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return value, (), {k: v for k, v in kwargs.items() if k != key}, key
    raise TypeError(
        f"a block was called with no positional argument and no tensor among its keyword arguments "
        f"({sorted(kwargs)}); remat passes the block's input through the checkpoint. Name blocks that "
        "are called with their input tensor."
    )


def call_with_first(forward: Callable[..., Any], first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any],
                    key: str | None) -> Any:
    """``forward`` called as the model called the block (`first_argument`'s inverse)."""
    return forward(first, *extra, **kwargs) if key is None else forward(*extra, **{key: first}, **kwargs)


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    """Bookkeeping copies must not be seen by the selective-checkpoint cache (it would expect
    them in the replay) nor counted as the step's ops."""
    with _disable_current_modes(), torch.no_grad():
        yield


class BufferGuard:
    """Undo buffer updates made by a replay (BatchNorm running statistics...), and parameter
    updates a forward makes in place (EDM2's forced weight normalisation).

    Torch tells the forward from the replay: `checkpointed` hands `forward` and `replay` to
    the checkpoint as its (forward, recompute) contexts. Which buffers a forward changes is found
    once per region and training mode by comparing values (the kernels that update running
    statistics do not bump version counters) and kept in ``known``, shared by every guard of the
    same blocks. A replay leaves them as they were (`replay`), so they advance once per step, as
    without recomputation. Nothing is counted inside the region, so a compiled
    region has no side effect of remat's (under ``torch.compile`` the guard is left out: the
    compiled backward replays no buffer update)."""

    def __init__(self, blocks: Sequence[nn.Module], known: dict[tuple[Any, ...], list[torch.Tensor]],
                 name: tuple[Any, ...] = ()) -> None:
        self.blocks = blocks
        self.known = known
        self.name = name
        """Tells regions apart in ``known`` (the runtime's ``(start, stop)``)."""
        self.modules = layers_of(m for block in blocks for m in block.modules())
        """Every module of the blocks, listed once: the key reads their training flags on every
        forward and replay, and walking the module tree each time cost more than the flags."""
        self.observed = {id(b) for m in self.modules if _observes(m) for b in m.buffers(recurse=False)}
        """Buffers of quantization observers and fake-quantizers (QAT): counted as changed by every
        forward, whether or not the one that learns changed them (a weight observer's min and max
        stay put in a step whose weights equal the last step's, and move after the optimizer's step:
        learned from such a forward, the guard went idle and later replays advanced the observers
        again, so the fake-quantized weights and the gradients differed from the second step on)."""
        self.mappings = _held_mappings(self.modules)
        """The mappings the blocks' modules hold as attributes when the plan is applied (a table
        cache the layers share): a replay finds them as its forward did (`_MappingsAsFound`)."""
        self._plans: dict[tuple[Any, ...], tuple[list[_Swap], list[torch.Tensor], list[torch.Tensor]]] = {}
        """Per training mode: what a replay swaps and copies (`_plan`), and the ``known`` list it
        was made for."""

    def _key(self) -> tuple[Any, ...]:
        return (*self.name, tuple(m.training for m in self.modules))

    def idle(self) -> bool:
        """Whether the region's forward is known to change no buffer in the current training
        mode: then neither its forward nor its replay needs the guard."""
        return self.known.get(self._key()) == []

    @contextlib.contextmanager
    def forward(self, call: _Call | None = None) -> Iterator[None]:
        """The region's forward: the first one in a training mode learns what it changes. With
        ``call`` (one per checkpointed call, shared with its `replay`): the values the forward
        starts from of the buffers it changes that are copied, not swapped (`_plan`)."""
        key = self._key()
        if key in self.known:
            if call is not None and self.known[key]:
                _, copied = self._plan(key, self.known[key])
                if copied:
                    with _outside_modes():
                        call.before = [_copy(b) for b in copied]
                    call.attributes = snapshot(self.modules)
            yield
            return
        # parameters too: a forward that writes its weights (EDM2's forced weight normalisation,
        # ``weight.copy_(normalize(weight))`` under no_grad) would write them again in the replay
        buffers = [b for block in self.blocks for b in (*block.buffers(), *block.parameters())]
        with _outside_modes():
            before = [_copy(b) for b in buffers]
        versions = [b._version for b in buffers]
        attributes = snapshot(self.modules) if call is not None else None
        guests = _Guests(self.modules) if call is not None else None
        with guests if guests is not None else contextlib.nullcontext():
            yield
        if call is not None and guests is not None:
            call.guests = guests.filled()
        with _outside_modes():
            self.known[key] = [b for b, v, n in zip(buffers, before, versions)
                               if id(b) in self.observed or not _same(b, v, n)]
        if call is not None and self.known[key]:
            _, copied = self._plan(key, self.known[key])
            start = {id(b): v for b, v in zip(buffers, before)}
            call.before = [start[id(b)] for b in copied]
            call.attributes = attributes

    @contextlib.contextmanager
    def replay(self, call: _Call | None = None) -> Iterator[None]:
        """The region's replay (`_replay`), with the modules outside the region that its first
        forward called and that filled a cache there (`_Guests`) as that forward found them."""
        guests = call.guests if call is not None else []
        if not guests:
            with self._replay(call):
                yield
            return
        warm = [(module, dict(module._buffers), snapshot([module])) for module, _, _ in guests]
        for module, buffers, attributes in guests:
            _set_buffers(module, buffers)
            put_back(attributes)
        try:
            with self._replay(call):
                yield
        finally:
            for module, buffers, attributes in warm:
                _set_buffers(module, buffers)
                put_back(attributes)

    @contextlib.contextmanager
    def _replay(self, call: _Call | None = None) -> Iterator[None]:
        """The region's replay: the buffers its forward changes are put back after it.

        A training BatchNorm's running statistics are not read by its forward (it normalizes by
        the batch's statistics), so the replay updates stand-ins instead: the module's buffers
        are swapped for scratch tensors of the same shape and swapped back, with no copy. Any
        other buffer the forward changes may be read by it (spectral norm's power-iteration
        vectors, which the forward advances and then uses): the replay runs from the values the
        forward started from (``call.before``, copied by `forward`), and the buffers get back the
        values they had before the replay. The modules' plain attributes go with them
        (`remat.checkpointing.attributes`): a cache whose table is a buffer and whose filled length
        an ``int`` (rotary_embedding_torch) is replayed empty, as the forward found it, not as
        zeros the code believes filled (the first step's gradients were wrong)."""
        key = self._key()
        known = self.known.get(key)
        if not known:
            yield
            return
        swaps, copied = self._plan(key, known)
        saved, attributes = [], None
        if copied:
            with _outside_modes():
                saved = [_copy(b) for b in copied]
                if call is not None and call.before is not None:
                    for buf, value in zip(copied, call.before):
                        _put(buf, value)
            if call is not None and call.attributes is not None:
                owners = buffer_owners(self.modules, copied)
                attributes = snapshot(owners)
                put_back(call.attributes, owners)
        for module, name, _, scratch in swaps:
            module._buffers[name] = scratch
        try:
            yield
        finally:
            for module, name, buf, _ in swaps:
                module._buffers[name] = buf
            if copied:
                with _outside_modes():
                    for buf, value in zip(copied, saved):
                        _put(buf, value)
            if attributes is not None:
                put_back(attributes)

    def _plan(self, key: tuple[Any, ...], known: list[torch.Tensor]) -> tuple[list[_Swap], list[torch.Tensor]]:
        """For the training mode ``key``: the swaps (each changed buffer of a training BatchNorm
        that tracks running statistics, with its scratch made once) and the buffers to copy."""
        cached = self._plans.get(key)
        if cached is not None and cached[2] is known:
            return cached[0], cached[1]
        changed = {id(b) for b in known}
        swaps = []
        for module in self.modules:
            if isinstance(module, _BatchNorm) and module.training and module.track_running_stats:
                for name, buf in module._buffers.items():
                    if buf is not None and id(buf) in changed:
                        with _outside_modes():
                            swaps.append((module, name, buf, buf.detach().clone()))
        swapped = {id(buf) for _, _, buf, _ in swaps}
        copied = [b for b in known if id(b) not in swapped]
        self._plans[key] = (swaps, copied, known)
        return swaps, copied


def _observes(module: nn.Module) -> bool:
    """Whether ``module`` is a quantization observer or fake-quantizer (`torch.ao.quantization`),
    whose buffers its forward updates from what it sees."""
    bases = tuple(getattr(_ao_quantization(), name, None) for name in ("ObserverBase", "FakeQuantizeBase"))
    return isinstance(module, tuple(b for b in bases if isinstance(b, type)))


def _ao_quantization() -> Any:
    return sys.modules.get("torch.ao.quantization")  # loaded by whoever built the QAT model; none otherwise


def _put(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """``value`` into ``buffer`` in place, resized to its shape first where the forward resized it."""
    if buffer.shape != value.shape:
        buffer.resize_(value.shape)
    buffer.copy_(value)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a buffer where it lives, of a parameter in host memory: the first forward of a
    region compares every weight of its blocks, which on an accelerator would hold a second copy
    of a block's weights beside its forward."""
    if isinstance(t, nn.Parameter) and t.device.type not in ("cpu", "meta"):
        return t.detach().to("cpu", copy=True)
    return t.detach().clone()


def _same(after: torch.Tensor, before: torch.Tensor, version: int) -> bool:
    """Whether a buffer holds what it held (a per-channel observer's empty buffers are resized in
    place by the first forward: another shape is a change). A tensor subclass that cannot be
    compared (QLoRA's NF4 weights have no ``aten.equal``: every block of a QLoRA model was taken
    as unable to recompute) is the same where its version counter did not move: an in-place write
    moves it."""
    if after.shape != before.shape:
        return False
    try:
        return torch.equal(after.detach().to(before.device), before)
    except (NotImplementedError, RuntimeError, TypeError):
        return after._version == version


_Swap = tuple[nn.Module, str, torch.Tensor, torch.Tensor]
"""(module, buffer name, the buffer, its scratch stand-in)."""


class _Call:
    """One checkpointed call's state shared by its forward and its replay."""

    __slots__ = ("before", "attributes", "guests")

    def __init__(self) -> None:
        self.before: list[torch.Tensor] | None = None
        self.attributes: AttributeSnapshot | None = None
        """The plain attributes of the region's modules as its forward began (`BufferGuard.replay`)."""
        self.guests: list[tuple[nn.Module, dict[str, torch.Tensor | None], AttributeSnapshot]] = []
        """Modules outside the region that its forward called and that filled a cache then, with
        their buffers and plain attributes as the forward found them (`_Guests`)."""


class _Guests:
    """While a region's first forward runs: the modules outside the region it calls that hold
    buffers (a bias module the model hands every layer: x-transformers' ALiBi), each with its
    buffers (the objects) and plain attributes as the forward first called it. `filled` names
    those whose buffers the forward replaced or added: a cache filled on the first call (the bias
    registered then). A replay of that call must find them as the forward did: else it reads the
    cache where the forward computed it, and a selective replay, whose calls must repeat the
    forward's, failed the first step of every fresh model."""

    def __init__(self, own: Sequence[nn.Module]) -> None:
        self.own = {id(m) for m in own}
        self.seen: dict[int, tuple[nn.Module, dict[str, torch.Tensor | None], AttributeSnapshot]] = {}
        self.handle: Any = None

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.own or id(module) in self.seen or not module._buffers:
            return
        self.seen[id(module)] = (module, dict(module._buffers), snapshot([module]))

    def __enter__(self) -> _Guests:
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()

    def filled(self) -> list[tuple[nn.Module, dict[str, torch.Tensor | None], AttributeSnapshot]]:
        return [(module, buffers, attributes) for module, buffers, attributes in self.seen.values()
                if set(module._buffers) != set(buffers) or any(module._buffers[n] is not b for n, b in buffers.items())]


def _set_buffers(module: nn.Module, buffers: dict[str, torch.Tensor | None]) -> None:
    """``module``'s buffers made ``buffers`` (the objects, names gained since dropped)."""
    module._buffers.clear()
    module._buffers.update(buffers)


def checkpointed(body: Body, first: Any, extra: tuple[Any, ...], *, guard: BufferGuard,
                 context_fn: Callable[[], tuple[Any, Any]] | None = None, early_stop: bool = False,
                 kwargs: dict[str, Any] | None = None) -> list[Any]:
    """``body(first, extra)``'s outputs, computed under one non-reentrant checkpoint that keeps
    only ``first`` and ``extra``; ``context_fn``: torch's (forward, recompute) context pair
    (selective checkpointing), a function or `functools.partial` (what ``torch.compile`` accepts);
    ``early_stop``: torch's, the replay stops at the region's last saved tensor; ``kwargs``: the
    keyword arguments ``body`` passes the blocks, whose mappings a replay leaves as it found them
    (`_MappingsRestored`), as it does ``extra``'s.

    Whether a run is the forward or the replay is torch's to say (the context pair), not a
    counter's inside the region: a region that mutates outside state breaks the graph under
    ``torch.compile`` (it would be replayed)."""

    def region(first: Any, *extra_args: Any) -> tuple[Any, ...]:
        with _uncached_casts():
            return tuple(body(first, extra_args))

    if torch.compiler.is_compiling():
        contexts = context_fn  # decided while tracing: the compiled graph keeps no guard
    else:
        contexts = functools.partial(_guarded, guard, context_fn, _mappings_in((*extra, kwargs or {})),
                                     _lists_in((first, *extra, kwargs or {})),
                                     kv_caches_in((*extra, *(kwargs or {}).values())))
    options: dict[str, Any] = {"context_fn": contexts} if contexts is not None else {}
    out = checkpoint(region, first, *extra, use_reentrant=False, preserve_rng_state=True,
                     early_stop=early_stop, **options)
    return list(out)


def autocast_state() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """``(device type, dtype, cache enabled)`` of each device type whose autocast is on now."""
    return tuple((device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())
                 for device_type in ("cpu", "cuda") if torch.is_autocast_enabled(device_type))


def autocast_entered(state: tuple[tuple[str, torch.dtype, bool], ...],
                     cache: bool | None = None) -> contextlib.AbstractContextManager[Any]:
    """``state`` (`autocast_state`) entered, its cache setting or ``cache``; nothing when empty."""
    stack = contextlib.ExitStack()
    for device_type, dtype, cached in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cached if cache is None else cache))
    return stack


def _uncached_casts() -> contextlib.AbstractContextManager[Any]:
    """Autocast as it is, but with its weight-cast cache off inside a checkpointed region: the
    cache keeps every cast of a weight until the outermost autocast exits (the end of a forward
    that enters it), so a recomputed block would hold its weights' casts through the rest of the
    forward, which its checkpoint is there to avoid (on a Llama under bfloat16 autocast, a plan
    measured one layer's cast weights over its prediction and its budget). The casts are the same
    values made again where an op needs them; the replay makes its own. Nothing changes when
    autocast is off, its cache already off, or under ``torch.compile``."""
    if torch.compiler.is_compiling() or not torch.is_autocast_cache_enabled():
        return contextlib.nullcontext()
    return autocast_entered(autocast_state(), cache=False)


def _guarded(guard: BufferGuard, context_fn: Callable[[], tuple[Any, Any]] | None,
             mappings: Sequence[MutableMapping[Any, Any]] = (), lists: Sequence[list[Any]] = (),
             caches: Sequence[Any] = ()) -> tuple[Any, Any]:
    """``context_fn``'s pair (none: no context) with the guard's forward and replay around them
    (none when the guard is idle), the replay marked (`replaying`), what it writes to the
    region's mapping arguments undone (`_MappingsRestored`), and its list arguments and key/value
    caches as they were when the region was called (`_ListsAsCalled`, `_CachesAsCalled`; torch
    calls this as the forward starts)."""
    inner = context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    restored = _both(_MappingsRestored(mappings), inner[1])
    if guard.mappings:
        found = _MappingsAsFound(guard.mappings)
        inner = (_both(found.recorded(), inner[0]), inner[1])
        restored = _both(found, restored)
    if lists:
        restored = _both(_ListsAsCalled(lists), restored)
    if caches:
        restored = _both(_CachesAsCalled(caches), restored)
    replay = _both(_ReplayMark(), _both(_StateDetached(guard.modules), restored))
    if guard.idle():
        return inner[0], replay
    call = _Call()
    return _both(guard.forward(call), inner[0]), _both(_Fresh(functools.partial(guard.replay, call)), replay)


class _Fresh:  # noqa: N801 (used as a context manager, like contextlib's)
    """``factory()`` entered anew on every entry. Torch enters a checkpoint's recompute context
    once per replay, and a step that backpropagates twice through a region replays it twice
    (``torch.autograd.grad(..., create_graph=True)`` for a gradient penalty or a physics-informed
    loss, then the loss's backward): a generator's context manager enters once only."""

    __slots__ = ("factory", "entered")

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self.entered: list[Any] = []

    def __enter__(self) -> Any:
        context = self.factory()
        value = context.__enter__()
        self.entered.append(context)
        return value

    def __exit__(self, *exc: Any) -> bool:
        return bool(self.entered.pop().__exit__(*exc))


_REPLAYS = threading.local()


def replaying() -> bool:
    """Whether a checkpointed region is being replayed on this thread (torch's recompute context
    says so, eager only). Nothing reads a replay's outputs: the runtime then lets each block's
    output go once the next block has it (`remat.apply.runtime.Runtime.run_plain`), where the
    forward must hand every one to the model's code."""
    return getattr(_REPLAYS, "depth", 0) > 0


class _ReplayMark:
    """Counts the replays running on this thread (nested ones included)."""

    __slots__ = ()

    def __enter__(self) -> None:
        _REPLAYS.depth = getattr(_REPLAYS, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> bool:
        _REPLAYS.depth -= 1
        return False


class _StateDetached:
    """Tensors a replay leaves on the blocks' modules as attributes, detached when it ends.

    A layer that keeps a tensor of its forward on itself (RecurrentGemma's RG-LRU stores its
    recurrent state as ``self.recurrent_states`` on every forward, cache or not) stores the
    replay's copy too, and that copy's graph holds every tensor the replay saved: nothing
    backpropagates through it, yet it lived until the block's next forward, through the rest of
    the backward and the optimizer's step (RecurrentGemma's recomputing plans measured 17-23 %
    over their peaks). The replay repeats the forward's values, so the attribute keeps them,
    without the graph: attributes of the modules' ``__dict__`` that the replay set to a tensor
    with a graph, or to a tuple or list of tensors among which one has, are replaced by their
    ``detach()``. Parameters and buffers are not attributes there and are left alone."""

    __slots__ = ("modules", "before")

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules
        self.before: list[list[dict[str, int]]] = []

    def __enter__(self) -> None:
        self.before.append([{name: id(value) for name, value in vars(m).items()} for m in self.modules])

    def __exit__(self, *exc: Any) -> bool:
        for module, ids in zip(self.modules, self.before.pop()):
            attributes = vars(module)
            for name, value in list(attributes.items()):
                if ids.get(name) != id(value):
                    detached = _detached(value)
                    if detached is not value:
                        attributes[name] = detached
        return False


def _mappings_in(values: Sequence[Any]) -> list[MutableMapping[Any, Any]]:
    """The mutable mappings among a region's arguments, and among the values of a dict there (its
    keyword arguments): a state the model's layers share (Gemma 4's ``shared_kv_states``)."""
    found: list[MutableMapping[Any, Any]] = []
    for value in values:
        if isinstance(value, MutableMapping):
            found.append(value)
            if isinstance(value, dict):
                found.extend(v for v in value.values() if isinstance(v, MutableMapping))
    return found


def _lists_in(values: Sequence[Any]) -> list[list[Any]]:
    """The lists among a region's arguments, in tuples and in a dict's values (its keyword
    arguments) too."""
    found: list[list[Any]] = []
    for value in values:
        if isinstance(value, list):
            found.append(value)
            found.extend(_lists_in(value))
        elif isinstance(value, tuple):
            found.extend(_lists_in(value))
        elif isinstance(value, dict):
            found.extend(_lists_in(list(value.values())))
    return found


class _ListsAsCalled:
    """The region's list arguments as they were when it was called, for the length of a replay.

    A list the model's code passes a block and goes on appending to (timm's DenseNet hands each
    dense layer the list of every feature map so far, then appends the layer's output) holds more
    by the time the block replays: the replay concatenated more channels than the forward did
    (DenseNet's replays failed, "running_mean should contain 256 elements not 248"; a block reading
    the list's last item would have replayed on another tensor, silently). Each list holds its
    call-time items during the replay and its current ones again after."""

    __slots__ = ("lists", "called", "now")

    def __init__(self, lists: Sequence[list[Any]]) -> None:
        self.lists = lists
        self.called = [list(items) for items in lists]
        self.now: list[list[list[Any]]] = []

    def __enter__(self) -> None:
        self.now.append([list(items) for items in self.lists])
        for items, called in zip(self.lists, self.called):
            items[:] = called

    def __exit__(self, *exc: Any) -> bool:
        for items, now in zip(self.lists, self.now.pop()):
            items[:] = now
        return False


class _CachesAsCalled:
    """The region's Hugging Face key/value caches as they were when it was called, for the length
    of a replay.

    A cache handed to a block that holds positions already (prefix tuning's virtual tokens: peft
    hands every layer a cache filled with its prefix's keys and values) is appended to by the
    block's forward, and would be again by its replay: the replayed attention read its own keys
    twice (so peft refuses gradient checkpointing with prefix tuning, and Hugging Face's drops the
    cache, prefix and all). During a replay each cache holds what it held when the region was
    called, and what it holds now again after (`remat.checkpointing.caches.CacheState`): the
    replay's keys and values go with the replay."""

    __slots__ = ("called", "now")

    def __init__(self, caches: Sequence[Any]) -> None:
        self.called = [CacheState(cache) for cache in caches]
        self.now: list[list[CacheState]] = []

    def __enter__(self) -> None:
        self.now.append([CacheState(state.cache) for state in self.called])
        for state in self.called:
            state.restore()

    def __exit__(self, *exc: Any) -> bool:
        for state in self.now.pop():
            state.restore()
        return False


class _MappingsRestored:
    """What a replay writes to the region's mapping arguments, undone when it ends.

    Gemma 4's layers that store their keys and values write them to a mapping every layer is
    handed (``shared_kv_states``), for the layers after them to read. A replay writes its own
    copies there, with their graph, and the mapping outlived the replay to the end of the
    backward: each replayed storing layer's keys and values, and what they saved, stayed live
    through the backward of the layers before it (full recomputation of a 4-layer Gemma 4
    measured 3.9 % over its prediction). The layers that read them replayed before (the backward
    runs in reverse), from the forward's entries, which the replay's repeat: every entry the
    replay set to a value with a graph goes back to what it was, or goes when the replay added it."""

    __slots__ = ("mappings", "before")

    def __init__(self, mappings: Sequence[MutableMapping[Any, Any]]) -> None:
        self.mappings = mappings
        self.before: list[list[dict[Any, Any]]] = []

    def __enter__(self) -> None:
        self.before.append([dict(m.items()) for m in self.mappings])

    def __exit__(self, *exc: Any) -> bool:
        for mapping, before in zip(self.mappings, self.before.pop()):
            for key, value in list(mapping.items()):
                if (key not in before or before[key] is not value) and _detached(value) is not value:
                    if key in before:
                        mapping[key] = before[key]
                    else:
                        del mapping[key]
        return False


def _held_mappings(modules: Sequence[nn.Module]) -> list[MutableMapping[Any, Any]]:
    """The mutable mappings ``modules`` hold as plain attributes, each once (a cache the layers
    share is held by each of them)."""
    found: dict[int, MutableMapping[Any, Any]] = {}
    for module in modules:
        for name, value in vars(module).items():
            if name not in MODULE_INTERNALS and isinstance(value, MutableMapping):  # hooks, submodules: mappings all
                found.setdefault(id(value), value)
    return list(found.values())


class _MappingsAsFound:
    """The mappings the region's modules hold, as its forward found them while the replay runs.

    A cache the layers share in a plain mapping, filled by the first layer's first forward and
    read by every later call (OLMo-core's ``BufferCache`` of rotary tables, a hand-written
    RoPE's dict): the forward of the first layer computes the table, its replay found it filled
    and read it, and a selective replay, whose calls must repeat the forward's, failed the first
    step of every fresh model. `recorded` notes the mappings' entries as the forward starts; the
    replay sees those entries, and the mappings get back what they held when it began."""

    __slots__ = ("mappings", "found", "held")

    def __init__(self, mappings: Sequence[MutableMapping[Any, Any]]) -> None:
        self.mappings = mappings
        self.found: list[dict[Any, Any]] | None = None
        self.held: list[list[tuple[MutableMapping[Any, Any], dict[Any, Any]]]] = []

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        self.found = [dict(m.items()) for m in self.mappings]
        yield

    def __enter__(self) -> None:
        swapped = []
        for mapping, found in zip(self.mappings, self.found or ()):
            now = dict(mapping.items())
            if now.keys() != found.keys() or any(now[k] is not v for k, v in found.items()):
                _refill(mapping, found)
                swapped.append((mapping, now))
        self.held.append(swapped)

    def __exit__(self, *exc: Any) -> bool:
        for mapping, now in self.held.pop():
            _refill(mapping, now)
        return False


def _refill(mapping: MutableMapping[Any, Any], entries: dict[Any, Any]) -> None:
    mapping.clear()
    mapping.update(entries)


def _detached(value: Any) -> Any:
    """``value`` without its graph (a tensor, or a tuple or list of them); ``value`` itself when it
    has none."""
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return value.detach() if value.grad_fn is not None else value
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in value):
        items = [v.detach() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) else v for v in value]
        return type(value)(items) if type(value) in (tuple, list) else value
    return value


class _both:  # noqa: N801 (used as a context manager, like contextlib's)
    """``with outer, inner`` as one context manager, without a generator frame."""

    __slots__ = ("outer", "inner")

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException:
            if not self.outer.__exit__(*sys.exc_info()):
                raise

    def __exit__(self, *exc: Any) -> bool:
        try:
            suppressed = bool(self.inner.__exit__(*exc))
        except BaseException:
            if not self.outer.__exit__(*sys.exc_info()):
                raise
            return True
        if suppressed:
            exc = (None, None, None)
        return bool(self.outer.__exit__(*exc)) or suppressed
