"""Storage identity: the unit every byte count in remat is made of.

A storage is identified by ``t.untyped_storage()._cdata`` (the address of its StorageImpl),
not by ``data_ptr``: it works the same on the meta device, where there is no data, so the
meta-device estimate counts exactly what a real run counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside a wrapper tensor subclass (a DTensor's local shard), recursively;
    ``[t]`` for a plain tensor.

    A wrapper's own storage is a placeholder of the *global* size: counting it would count a
    sharded parameter, or a tensor-parallel activation, as if it were whole on every rank."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inners = (getattr(t, name) for name in names)
    return [p for inner in inners if isinstance(inner, torch.Tensor) for p in plain_tensors(inner)]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage the tensor's bytes live in: a wrapper subclass's first inner tensor's."""
    return plain_tensors(t)[0].untyped_storage() if is_traceable_wrapper_subclass(t) else t.untyped_storage()


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of the tensor's storage (a DTensor's: its local shard's), or None for tensors
    without one (sparse, nested)."""
    try:
        return storage_of(t)._cdata
    except (NotImplementedError, RuntimeError, IndexError):
        return None


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's whole storage, a DTensor's local shard's (0 without one)."""
    if is_traceable_wrapper_subclass(t):
        return sum(storage_nbytes(p) for p in plain_tensors(t))
    try:
        return t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return 0


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists, dicts and dataclass-like outputs."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    # every field of a dataclass, before its ``to_tuple``: x-transformers' ``Intermediates.to_tuple``
    # leaves out its keys and values, which a block returns in it
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(_field(value, f.name))]
    if hasattr(value, "to_tuple"):  # Hugging Face ModelOutput
        return tensors_in(value.to_tuple())
    return []


def _field(value: Any, name: str) -> Any:
    """``value.name``, or None where reading it raises: a dataclass may guard a field (Gemma 4's
    config raises for a per-layer attribute read globally)."""
    try:
        return getattr(value, name, None)
    except Exception:
        return None


def flat_tensors(args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or results (lists and tuples one level deep):
    a fast path for dispatch modes, which see no deeper nesting."""
    found = []
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by several counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        key = storage_key(t)
        if key is not None:
            seen[key] = storage_nbytes(t)
    return sum(seen.values())


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage identities of ``tensors``."""
    return {k for k in (storage_key(t) for t in tensors) if k is not None}
