"""A module's plain attributes: what its code keeps besides parameters, buffers and submodules.

A forward may change them along with its buffers: a lazily made cache keeps its table in a
buffer and how much of it is filled in an ``int`` (rotary_embedding_torch's ``cached_freqs`` and
``cached_freqs_seq_len``), a data-dependent initialisation its parameters and an ``initialized``
flag. Whoever puts a module's buffers back must put its attributes back too, or the code reads a
table it believes filled and finds the values it started from (zeros: every rotation the
identity). `snapshot` records them; `put_back` makes the attributes of the modules whose buffers
were put back what the snapshot holds again (only those: a model's other attributes go with
other state, a flag beside the hooks a first forward installs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["AttributeSnapshot", "MODULE_INTERNALS", "buffer_owners", "snapshot", "put_back"]

MODULE_INTERNALS = frozenset(vars(nn.Module()).keys())
"""The attributes every module has (``training``, ``_parameters``, the hook dictionaries...)."""
_SCALARS = (bool, int, float, complex, str, bytes, type(None))

AttributeSnapshot = list[tuple[nn.Module, dict[str, Any]]]
"""Per module, its plain attributes by name."""


def _plain(value: Any) -> bool:
    """A value the snapshot keeps: a scalar, a tensor (by reference) or a tuple of them. Not a
    tensor with a history: a result the forward left on the module (``torch.nn.utils.spectral_norm``'s
    weight, which its pre-hook computes at every call), not state a replay starts from; held by the
    snapshot, a replay kept the last one alive beside its own."""
    if isinstance(value, torch.Tensor):
        return value.grad_fn is None
    if isinstance(value, _SCALARS):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if name not in MODULE_INTERNALS and _plain(value)}


def snapshot(modules: Iterable[nn.Module]) -> AttributeSnapshot:
    """The plain attributes of ``modules``: scalars, tensors (the objects, not their values) and
    tuples of them; other objects (a config, a list) are left alone."""
    return [(module, _attributes(module)) for module in modules]


def put_back(saved: AttributeSnapshot, modules: Iterable[nn.Module] | None = None) -> None:
    """Give the modules of ``saved`` (those of ``modules`` only, when given) their recorded plain
    attributes again. Attributes gained since stay: a flag the forward sets beside hooks it installs
    on its first call (Hugging Face's ``_output_capturing_hooks_installed``) must stay with them."""
    only = None if modules is None else {id(m) for m in modules}
    for module, attributes in saved:
        if only is None or id(module) in only:
            vars(module).update(attributes)


def buffer_owners(modules: Iterable[nn.Module], buffers: Iterable[torch.Tensor]) -> list[nn.Module]:
    """The modules among ``modules`` that hold one of ``buffers`` as their own: the attributes that
    go with a buffer are its module's."""
    wanted = {id(b) for b in buffers}
    return [m for m in modules if any(id(b) in wanted for b in m._buffers.values() if b is not None)]
