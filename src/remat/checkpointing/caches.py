"""Hugging Face key/value caches where blocks are replayed: turned off, with a warning.

A cache is appended to by every forward of a layer, so a replay would append the keys and
values a second time; training does not read it. Hugging Face's own gradient checkpointing
turns it off in training (``use_cache=True`` is incompatible with gradient checkpointing.
Setting ``use_cache=False``). remat does the same wherever gradients are enabled, in the
profile, in `remat.verify`'s runs and under an applied plan (`CacheOff`), so that what is
measured, what is predicted and what runs are the same step; blocks still handed an empty cache
(a wrapper passing its own, a model that makes one whatever ``use_cache`` says) get None instead
(`drop_kv_caches`, `CacheOff.drop_in`). Either way the user is told once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["CACHE_WARNING", "CacheOff", "CacheState", "as_in_training", "PREFILLED_CACHE", "SHARED_CACHE", "cache_positions",
           "cache_tensors", "drop_kv_caches", "is_kv_cache", "kv_caches_in"]

CACHE_WARNING = (
    "use_cache=True is incompatible with remat's recomputation (a replayed layer would append to "
    "the key/value cache again). Setting use_cache=False where gradients are enabled, as Hugging "
    "Face's gradient checkpointing does; pass use_cache=False (or set model.config.use_cache = False) "
    "to silence this. Training with the cache on, attention reads the cache's copies of the keys and "
    "values, so its gradients may differ from these in the last bits; remat.verify compares with "
    "use_cache=False, as the plan runs."
)


def _warn() -> None:
    # issued from this one line, so Python's default filter shows it once per process
    warnings.warn(CACHE_WARNING, UserWarning, stacklevel=1)


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers ``Cache``. transformers stays optional and is not
    imported here: without it loaded there is no cache (and ``torch.compile`` traces this)."""
    module = sys.modules.get("transformers.cache_utils")
    cache = getattr(module, "Cache", None)
    return cache is not None and isinstance(value, cache)


def cache_positions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The most positions a Hugging Face key/value cache among the arguments already holds (0 when
    none does): a training forward handed a filled cache (prefix tuning's virtual tokens) needs
    what it holds."""
    held = [v.get_seq_length() for v in (*args, *kwargs.values()) if is_kv_cache(v)]
    return max((int(n) for n in held), default=0)


def kv_caches_in(values: Any) -> list[Any]:
    """The Hugging Face key/value caches among ``values`` (a block's positional arguments and its
    keyword arguments' values), each once."""
    found: dict[int, Any] = {}
    for value in values:
        if is_kv_cache(value):
            found.setdefault(id(value), value)
    return list(found.values())


class CacheState:
    """What a Hugging Face key/value cache holds at one moment, to put back later: the attributes
    of the cache and of the objects of ``transformers.cache_utils`` it holds (transformers 5's
    layers; an encoder-decoder's two caches), lists among them copied, tensors by reference (or,
    with ``detach``, detached as a block's captured inputs are, so that probes never backpropagate
    into the step the cache was captured from).

    A block handed a cache that already holds positions (prefix tuning's virtual tokens) appends
    its keys and values to it in its forward; its replay must see the cache as the forward found
    it, or it would attend to its own keys twice (`remat.checkpointing.region`); the cache gets
    back what it held before the replay once the replay ends."""

    __slots__ = ("cache", "entries")

    def __init__(self, cache: Any, *, detach: bool = False) -> None:
        self.cache = cache
        self.entries: list[tuple[Any, dict[str, Any]]] = []
        self._record(cache, detach, set())

    def _record(self, obj: Any, detach: bool, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        state: dict[str, Any] = {}
        for name, value in vars(obj).items():
            if isinstance(value, list):
                value = list(value)
                for item in value:
                    if _of_cache_utils(item):
                        self._record(item, detach, seen)
                if detach:
                    value = [_detached_leaf(v) for v in value]
            elif _of_cache_utils(value):
                self._record(value, detach, seen)
            elif detach:
                value = _detached_leaf(value)
            state[name] = value
        self.entries.append((obj, state))

    def restore(self) -> None:
        """Put back what the cache held (a list attribute gets a copy: the cache appends to it)."""
        for obj, state in self.entries:
            attributes = vars(obj)
            attributes.clear()
            attributes.update({k: list(v) if isinstance(v, list) else v for k, v in state.items()})


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a Hugging Face key/value cache holds (its layers' keys and values), as
    `CacheState` walks it."""
    state = CacheState(cache)
    found: list[torch.Tensor] = []
    for _, attributes in state.entries:
        for value in attributes.values():
            found += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, torch.Tensor)]
    return found


def _of_cache_utils(value: Any) -> bool:
    return type(value).__module__ == "transformers.cache_utils" and hasattr(value, "__dict__")


def _detached_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    return value


SHARED_CACHE = ("it writes a key/value cache that the model reads later in the same step (an encoder filling the cache "
                "its decoder attends to, as DiffusionGemma's does): the cache is left to the blocks, and a replay would "
                "write it again")
"""Why a block handed a cache in a model whose step reads what its blocks write there is never
replayed (`remat.measure.types.Fingerprint.shared_cache`)."""

PREFILLED_CACHE = ("it is handed a key/value cache that already holds positions (prefix tuning's virtual tokens, or a "
                   "cache passed in): a replay would append to it again, and without it the block would not see those "
                   "positions")
"""Why a block handed a filled cache (`cache_positions`) was never replayed, in profiles made
before its replays saw the cache as the forward found it (`CacheState`): the
`remat.measure.types.BlockProfile.unavailable` reason such a profile holds."""


def _empty(value: Any) -> bool:
    return is_kv_cache(value) and not int(value.get_seq_length())


def drop_kv_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every empty Hugging Face key/value cache replaced by None
    (warned): nothing the block needs is in it, and a replay would append to it again. A cache
    that holds positions (`cache_positions`: prefix tuning's virtual tokens) is the block's input
    and stays; a region replaying the block hands it the cache as its forward found it
    (`CacheState`, `remat.checkpointing.region`)."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache is None or not any(isinstance(v, cache) for v in (*args, *kwargs.values())):
        return args, kwargs  # asked of every planned block call: one lookup, then isinstance
    if not any(_empty(v) for v in (*args, *kwargs.values())):
        return args, kwargs
    if not torch.compiler.is_compiling():
        _warn()
    args = tuple(None if _empty(v) else v for v in args)
    return args, {k: None if _empty(v) else v for k, v in kwargs.items()}


def _takes_use_cache(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes ``use_cache`` and may make a cache with it. BERT's family
    takes it for use as a decoder and makes none unless ``config.is_decoder``: an encoder is not
    hooked (every remat call on a masked LM warned of a cache it never makes)."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", None) is None:
        return False
    try:
        if "use_cache" not in inspect.signature(module.forward).parameters:
            return False
    except (TypeError, ValueError):  # a forward without a signature
        return False
    return getattr(config, "is_decoder", True) is not False or not _caches_as_decoder_only(type(module))


@functools.lru_cache(maxsize=None)
def _caches_as_decoder_only(cls: type) -> bool:
    """Whether ``cls.forward`` reads ``config.is_decoder`` (BERT's: ``use_cache`` only as a decoder)."""
    try:
        return "self.config.is_decoder" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


_AS_IN_TRAINING = [False]
"""Set by `as_in_training` (a list: dynamo reads a module global where a hook runs compiled)."""


@contextlib.contextmanager
def as_in_training() -> Iterator[None]:
    """Within it, `CacheOff`'s hooks act without gradients too: a forward remat runs without
    gradients to see what the training step holds (`remat.measure.held.code_held_calls`) then runs
    as the step runs. Gemma 4's layers write their keys and values to the mapping every layer is
    handed only without a cache; with it on (``use_cache`` defaults to True) that forward saw none."""
    before = _AS_IN_TRAINING[0]
    _AS_IN_TRAINING[0] = True
    try:
        yield
    finally:
        _AS_IN_TRAINING[0] = before


def _training() -> bool:
    """Whether this forward is a training step's, as `CacheOff` turns caches off for."""
    return torch.is_grad_enabled() or _AS_IN_TRAINING[0]


def _cache_off_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """Forward pre-hook: ``use_cache=False`` when gradients are enabled and the call would cache."""
    if not _training():
        return None  # generation: the cache is what it is for
    asked = kwargs.get("use_cache")
    if asked is False or (asked is None and not module.config.use_cache):
        return None
    if not torch.compiler.is_compiling():  # a warning breaks a compiled graph; eager runs say it
        _warn()
    return args, {**kwargs, "use_cache": False}


def _inner_cache_off_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """`_cache_off_hook` for a module inside the model, which the model's own code calls: a call
    that asks for the cache by name (``use_cache=True``) reads it (PI0 hands its vision-language
    model's cache to its action expert, and crashed on None): left on. Its blocks are still handed
    none where the step does not read what they write (`CacheOff.drop_in`); where it does, they keep
    it and are never replayed (`SHARED_CACHE`)."""
    return None if kwargs.get("use_cache") is True else _cache_off_hook(module, args, kwargs)


def _drop_empty_cache_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    """Block forward pre-hook: an empty cache handed to the block becomes None when gradients
    are enabled, in every step remat measures, verifies or runs, kept and replayed blocks alike:
    a replay must not append to it, and a block run with it computes its attention from the
    cache's copies of the keys and values, not bit for bit the same (Flaubert's gradients 1e-11
    apart, and verify failed the plan). A cache that holds positions is left: the block needs
    them (a replay hands it the cache as its forward found it, `CacheState`)."""
    if torch.compiler.is_compiling() or not _training() or cache_positions(args, kwargs):
        return None  # a compiled model: its blocks run as the model calls them (the runtime drops a replayed one's)
    dropped = drop_kv_caches(args, kwargs)
    return None if dropped[0] is args and dropped[1] is kwargs else dropped


class _CountedDrop:
    """`_drop_empty_cache_hook`, counting the calls whose cache it dropped in ``count[0]``: an object
    of this module, so that a model it hooks can be pickled whole (``torch.save(model)``)."""

    def __init__(self, count: list[int]) -> None:
        self.count = count

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        dropped = _drop_empty_cache_hook(module, args, kwargs)
        self.count[0] += dropped is not None
        return dropped


class CacheOff:
    """Forward pre-hooks on the outermost Hugging Face modules of ``model`` (those with a
    ``config.use_cache`` and a ``use_cache`` argument) that turn the cache off in every forward
    with gradients enabled: `install`, `remove`, or ``with CacheOff(model): ...``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []
        self.block_handles: list[Any] = []
        self._dropped = [0]  # the blocks' hooks count here: they must not hold this, which holds the model

    @property
    def dropped(self) -> int:
        """Calls of the ``drop_in`` blocks whose cache was dropped."""
        return self._dropped[0]

    def install(self) -> CacheOff:
        hooked: list[str] = []
        for name, module in self.model.named_modules():
            if any(h == "" or name.startswith(h + ".") for h in hooked) or not _takes_use_cache(module):
                continue
            hooked.append(name)
            hook = _cache_off_hook if name == "" else _inner_cache_off_hook
            self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def drop_in(self, blocks: list[nn.Module]) -> CacheOff:
        """Also hand ``blocks`` no empty key/value cache in training (`_drop_empty_cache_hook`):
        a model that makes one whatever ``use_cache`` says (Flaubert's and XLM's attention
        layers get a fresh cache on every forward) runs its blocks as a replayed block must."""
        hook = _CountedDrop(self._dropped)
        self.block_handles.extend(b.register_forward_pre_hook(hook, with_kwargs=True) for b in blocks)
        return self

    def keep_in_blocks(self) -> None:
        """Undo `drop_in`: the blocks are handed their caches again (a model that reads in the step
        what its blocks write there, `remat.measure.types.Fingerprint.shared_cache`)."""
        for handle in self.block_handles:
            handle.remove()
        self.block_handles.clear()

    def remove(self) -> None:
        self.keep_in_blocks()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __enter__(self) -> CacheOff:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()
